"""The README's layout block names every module of the package, and nothing that is not there."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def readme_modules() -> set[str]:
    """Paths (relative to pipelinerl/) of the modules the README's `## Layout` block names: each line
    starts with a folder (`pipelinerl/` or a sub-folder like `trainer/`), followed by its modules; an
    indented line without a folder continues the one above."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Layout\n+```\n(.*?)```", text, re.S)
    assert block, "README.md has no ## Layout code block"
    named, folder = set(), None
    for line in block.group(1).splitlines():
        words = line.split()
        if line.startswith("pipelinerl/"):
            folder = ""
        elif line.startswith("  ") and words and words[0].endswith("/"):
            folder = words[0]
        elif not line.startswith(" "):  # configs/, tests/, ...
            folder = None
        if folder is None:
            continue
        named |= {folder + w for w in words if re.fullmatch(r"\w+\.py", w)}
    return named


def tree_modules() -> set[str]:
    root = REPO / "pipelinerl"
    return {str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "__init__.py"}


def test_readme_layout_matches_the_tree():
    named, present = readme_modules(), tree_modules()
    assert not named - present, f"README layout names modules that do not exist: {sorted(named - present)}"
    assert not present - named, f"README layout misses modules: {sorted(present - named)}"
