"""Benchmarks, kept apart from the reports: training throughput (`training`), the
accelerator check (`accelerator`), the batched patching table against the authors'
loop (`patch_speed`) and the real-size memory check (`real_size`). The checkpoint
benches reach a family only through its contract's `stand_in` (`families.contract`)."""
