"""Scene specs drawn as pictures a real VLM can read (the renderer).

Each object is a coloured glyph centred in its grid cell on a plain canvas: the label
picks the shape (`SHAPES`: circle, square, triangle, ...), the colour id a named
colour (`COLOURS`), and the facing an eye, a dark dot on the side the object faces
(0: none, 1: left, 2: right). The canvas is `size` pixels square; each cell gets
`size / w` x `size / h` pixels, so a size that is a multiple of 28 x the grid (e.g. 448
on a 4 x 4 grid: 112-pixel cells, 4 x 4 merged tokens of a 14-pixel-patch ViT with 2 x 2 merging) gives every merged
token one cell.

The glyphs are analytic masks on pixel centres measured from the cell's centre, every
one of them symmetric in x, so the picture of the mirrored spec (`spec.mirror`:
positions and facings mirrored) is the picture flipped left to right, pixel for pixel
(tested). Up-down they are not symmetric (a triangle points up, a heart's lobes are at
the top): a height mirror moves objects without turning them over, as in the world.

`draw_video` draws a scene as a video instead: grid row f is frame f (`data.tasks.video`),
and `VIDEO_TEMPLATES` ask about time ("Does the red circle appear before or after the
blue square?").

`questions(spec)` words each scene's question as the papers do ("Is the circle to the
left or the right of the square? Answer with one word."; `AUTHORS_TEMPLATES`: paper
003's authors' wording), and `object_names` gives the two names it mentions (the shape
alone where it names one object, else colour and shape), whose last sub-tokens a
family's spans point at.

NumPy only; axis names (`jaxmech.shapes`): B scenes, K object slots.
"""

from __future__ import annotations

import numpy as np

from jaxmech.data.spec import Grid, SceneSpec

SHAPES = (
    "circle", "square", "triangle", "star", "cross", "heart", "diamond", "ring", "hexagon", "plus",
)  # fmt: skip
COLOURS = {
    "red": (215, 38, 38),
    "green": (34, 160, 60),
    "blue": (35, 85, 215),
    "yellow": (235, 200, 20),
    "purple": (140, 50, 170),
    "orange": (245, 130, 20),
}
BACKGROUND = (255, 255, 255)
EYE = (20, 20, 20)
RADIUS = 0.36  # a glyph's half-size, in cells
# the papers' wording per relation (0 horizontal, 1 vertical, 2 presence)
TEMPLATES = (
    "Is the {x} to the left or the right of the {y}? Answer with one word.",
    "Is the {x} above or below the {y}? Answer with one word.",
    "Is there {a} {x} in the image? Answer with one word.",
)
# paper 003's authors' scripts' wording (adversarial_steering.py, spatial_finetuning/
# train.py): "left or right" and a quoted answer list; answers read lower-case
AUTHORS_TEMPLATES = (
    'Is the {x} to the left or right of the {y}? Answer "left" or "right" only.',
    'Is the {x} above or below the {y}? Answer "above" or "below" only.',
    'Is there {a} {x} in the image? Answer "yes" or "no" only.',
)
# a video's (`draw_video`): relation 1 is time, as the toy's video task has it
VIDEO_TEMPLATES = (
    TEMPLATES[0],
    "Does the {x} appear before or after the {y}? Answer with one word.",
    "Is there {a} {x} in the video? Answer with one word.",
)
MIDDLE = "centre of the image"  # what a question names when Y's label is 0
# the words each wording's answers begin with, by relation: jaxmech's capitalised (the
# answer starts the assistant's turn, where a chat model writes a capital), the authors'
# the lower-case words their prompt quotes; a video's relation 1 is time. Rows 3 and 4
# are photographs' relations no drawn scene has (What'sUp's on / under, front / behind;
# `reports.batches.PHOTO_RELATIONS`): here so each family reads their ids from its own
# tokenizer as it reads left / right's
ANSWERS = (("Left", "Right"), ("Above", "Below"), ("Yes", "No"), ("On", "Under"),
           ("Front", "Behind"))  # fmt: skip
AUTHORS_ANSWERS = (("left", "right"), ("above", "below"), ("yes", "no"), ("on", "under"),
                   ("front", "behind"))  # fmt: skip
VIDEO_ANSWERS = (("Left", "Right"), ("Before", "After"), ("Yes", "No"))
WORDINGS = {"jaxmech": (TEMPLATES, ANSWERS), "authors": (AUTHORS_TEMPLATES, AUTHORS_ANSWERS)}


def wording(name: str) -> tuple[tuple, tuple]:
    """(question templates, answer words) of a checkpoint view's `wording` (`WORDINGS`:
    "jaxmech" or the papers' authors'); ValueError naming `wording` otherwise."""
    if name not in WORDINGS:
        raise ValueError(f"wording = {name!r}: expected one of {', '.join(WORDINGS)}")
    return WORDINGS[name]


def _glyph(name: str, x, y):
    """bool mask of glyph `name` at coordinates x, y (glyph radius 1; y grows downward)."""
    r, ax, ay = np.hypot(x, y), np.abs(x), np.abs(y)
    if name == "circle":
        return r <= 1
    if name == "square":
        return (ax <= 0.85) & (ay <= 0.85)
    if name == "triangle":  # apex up (y = -1), base at y = 0.8
        return (y >= -1) & (y <= 0.8) & (ax <= (y + 1.0) / 1.8 * 0.95)
    if name == "star":  # five points, one up
        t = np.arctan2(x, -y)  # 0 straight up, symmetric in x
        return r <= 0.45 + 0.55 * np.abs(np.cos(2.5 * t)) ** 3
    if name == "cross":  # an X
        return (np.abs(x - y) <= 0.3) & (r <= 1) | (np.abs(x + y) <= 0.3) & (r <= 1)
    if name == "heart":
        u, v = 1.15 * x, -1.15 * y + 0.25
        return (u**2 + v**2 - 1) ** 3 - u**2 * v**3 <= 0
    if name == "diamond":
        return ax + ay <= 1
    if name == "ring":
        return (r <= 1) & (r >= 0.6)
    if name == "hexagon":
        return (ay <= 0.87) & (ax * 0.87 + ay * 0.5 <= 0.87)
    if name == "plus":
        return ((ax <= 0.28) & (ay <= 1)) | ((ay <= 0.28) & (ax <= 1))
    raise ValueError(f"unknown glyph {name!r}; known: {', '.join(SHAPES)}")


def _tile(cell_h: int, cell_w: int, label: int, colour: int, facing: int) -> np.ndarray:
    """[cell_h, cell_w, 3] uint8: one object on the background."""
    half = RADIUS * min(cell_h, cell_w)
    # pixel centres relative to the cell's centre: a set symmetric under x -> -x
    x = (np.arange(cell_w) + 0.5 - cell_w / 2) / half
    y = (np.arange(cell_h) + 0.5 - cell_h / 2) / half
    x, y = np.meshgrid(x, y)
    tile = np.empty((cell_h, cell_w, 3), np.uint8)
    tile[:] = BACKGROUND
    tile[_glyph(SHAPES[label - 1], x, y)] = list(COLOURS.values())[colour - 1]
    if facing:
        side = -1.0 if facing == 1 else 1.0
        tile[np.hypot(x - side * 0.55, y + 0.2) <= 0.22] = EYE
    return tile


def check_spec(spec: SceneSpec) -> None:
    """Refuses labels, colours or facings the renderer cannot draw, naming the field."""
    drawn = np.asarray(spec.labels_BxK) > 0
    for field, values, top in (
        ("labels_BxK", spec.labels_BxK, len(SHAPES)),
        ("colours_BxK", spec.colours_BxK, len(COLOURS)),
        ("facings_BxK", spec.facings_BxK, 2),
    ):
        v = np.asarray(values)[drawn]
        low = 0 if field == "facings_BxK" else 1
        if v.size and (v.min() < low or v.max() > top):
            raise ValueError(
                f"spec.{field} holds {sorted(set(v.tolist()) - set(range(low, top + 1)))}: "
                f"the renderer draws {low}..{top}"
            )


def draw(grid: Grid, spec: SceneSpec, size: int = 448) -> np.ndarray:
    """[B, size, size, 3] uint8: every scene of `spec` as a picture (module docstring).
    Slots with label 0 or cell -1 are not drawn. Raises ValueError naming `size` when
    the grid does not divide it, or the spec field the renderer cannot draw."""
    if size % grid.w or size % grid.h:
        raise ValueError(f"size = {size}: must be a multiple of the grid's {grid.h} x {grid.w}")
    check_spec(spec)
    ch, cw = size // grid.h, size // grid.w
    cells, labels = np.asarray(spec.cells_BxK), np.asarray(spec.labels_BxK)
    colours, facings = np.asarray(spec.colours_BxK), np.asarray(spec.facings_BxK)
    out = np.empty((len(cells), size, size, 3), np.uint8)
    out[:] = BACKGROUND
    tiles: dict[tuple, np.ndarray] = {}
    for b, k in zip(*np.nonzero((labels > 0) & (cells >= 0))):
        key = (labels[b, k], colours[b, k], facings[b, k])
        if key not in tiles:
            tiles[key] = _tile(ch, cw, *(int(v) for v in key))
        r, c = divmod(int(cells[b, k]), grid.w)
        out[b, r * ch : (r + 1) * ch, c * cw : (c + 1) * cw] = tiles[key]
    return out


def object_names(spec: SceneSpec) -> list[tuple[str, str]]:
    """[B] (X's name, Y's name) of the first two slots: the shape alone ("circle") when
    no other object of the scene has that shape, else "colour shape"; "centre of the
    image" for a Y of label 0, "" for a presence question's unused Y. Shape alone where
    it names one object, so a recoloured twin (`spec.recolour`) keeps a question that is
    true of its picture: the control changes the picture, not the question's truth."""
    check_spec(spec)
    colour = list(COLOURS)
    out = []
    for labels, colours, rel in zip(
        np.asarray(spec.labels_BxK), np.asarray(spec.colours_BxK), np.asarray(spec.relation_B)
    ):
        shown = list(labels[labels > 0])

        def name(lab, c):
            if lab <= 0:
                return MIDDLE
            return (
                SHAPES[lab - 1] if shown.count(lab) == 1 else f"{colour[c - 1]} {SHAPES[lab - 1]}"
            )

        names = [name(lab, c) for lab, c in zip(labels[:2], colours[:2])]
        out.append((names[0], "" if rel == 2 else names[1]))
    return out


def draw_video(grid: Grid, spec: SceneSpec, size: int = 448) -> np.ndarray:
    """[B, grid.h, size, size, 3] uint8: every scene of `spec` as a video, its grid read
    as time (`data.tasks.video`): frame f shows the objects of grid row f in their columns,
    drawn as a 1 x grid.w row of cells filling the frame. Time reversal of the spec
    (`spec.mirror_height`) reverses the frames."""
    cells = np.asarray(spec.cells_BxK)
    frames = [
        draw(Grid(1, grid.w), spec._replace(cells_BxK=np.where(cells // grid.w == f,
                                                                cells % grid.w, -1)), size)
        for f in range(grid.h)
    ]  # fmt: skip
    return np.stack(frames, 1)


def questions(spec: SceneSpec, templates=TEMPLATES) -> list[str]:
    """[B] each scene's question in the papers' wording (`TEMPLATES`; a video's:
    `VIDEO_TEMPLATES`)."""
    return [
        templates[int(rel)].format(x=x, y=y, a="an" if x[:1] in "aeiou" else "a")
        for (x, y), rel in zip(object_names(spec), np.asarray(spec.relation_B))
    ]


def asked(grid: Grid, spec: SceneSpec, size: int, ask: SceneSpec | None = None,
          templates=TEMPLATES) -> tuple[list, list, list]:  # fmt: skip
    """(pictures [B], questions [B], object words [B] (X, Y)) of `spec` drawn at `size`
    and asked the questions of `ask` (default: `spec`'s own, so a twin keeps its
    example's question) in `templates`' wording: what a checkpoint view's `render` feeds
    its processor, as it feeds photographs (a presence question's Y is X: it names one
    object)."""
    ask = spec if ask is None else ask
    words = [(x, y or x) for x, y in object_names(ask)]
    return list(draw(grid, spec, size)), questions(ask, templates), words
