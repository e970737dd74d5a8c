"""The papers' datasets, one module per source, read into `questions.ImageQuestion`s
(`questions.load_questions`)."""
