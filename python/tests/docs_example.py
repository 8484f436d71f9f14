"""The runnable code blocks of docs/*.md: a fenced ```python block right
after an HTML comment `<!-- example: NAME -->`."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def example(name: str, doc: str = "docs/python.md") -> str:
    """Source of the block marked `<!-- example: name -->` in `doc` (relative
    to the repo root). Fails unless exactly one such block is there."""
    path = ROOT / doc
    lines = path.read_text(encoding="utf-8").splitlines()
    marker = f"<!-- example: {name} -->"
    at = [i for i, line in enumerate(lines) if line.strip() == marker]
    if len(at) != 1:
        raise AssertionError(f"{path}: expected one '{marker}', found {len(at)}")
    i = at[0] + 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    if i == len(lines) or lines[i].strip() != "```python":
        raise AssertionError(f"{path}:{i + 1}: '{marker}' is not followed by a ```python block")
    body = []
    for line in lines[i + 1:]:
        if line.strip() == "```":
            return "\n".join(body) + "\n"
        body.append(line)
    raise AssertionError(f"{path}:{i + 1}: the ```python block after '{marker}' is not closed")
