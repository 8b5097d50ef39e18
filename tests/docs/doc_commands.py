"""The commands of the documentation's runnable blocks, as the test sees them.

A fenced block preceded by `<!-- runnable -->` (or `<!-- runnable: e2e -->`) in README.md or docs/
is a tested block. Each of its command lines (backslash continuations joined, `# ...` comments
dropped) that runs dsrl becomes a `DocCommand`:

- `python -m dsrl.main ARGS`, `deepspeed ... --module dsrl.main ARGS`,
  `launch/multinode_deepspeed.sh HOSTFILE ARGS`: the Hydra overrides ARGS, and the number of ranks
  the launch starts (`--num_gpus N`, or the hostfile's slots);
- `python -m dsrl.serve ARGS`: the service's overrides;
- `make TARGET [ARGS="..."]`: the target, and when its recipe in the Makefile runs one of the
  above, that recipe's command with ARGS put in.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!--\s*runnable(?::\s*(?P<mode>[\w-]+))?\s*-->\s*$")
FENCE = re.compile(r"^(```|~~~)")


@dataclass
class DocCommand:
    page: str            # "docs/guides/own-data.md:12"
    line: str            # the command as written (continuations joined)
    kind: str            # "main" | "serve" | "make" | "other"
    overrides: List[str] = field(default_factory=list)
    world_size: int = 1
    make_target: Optional[str] = None
    e2e: bool = False
    cli_only: bool = False  # --help / --cfg: run the real CLI, nothing to compose


def doc_pages() -> List[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def runnable_blocks(path: Path):
    """(first line number, mode, [lines]) of each runnable block of one page."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i].strip())
        if not m:
            i += 1
            continue
        mode = m.group("mode") or ""
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j >= len(lines) or not FENCE.match(lines[j].strip()):
            raise ValueError(f"{path.relative_to(ROOT)}:{i + 1}: a runnable marker not followed by a fenced block")
        k = j + 1
        while k < len(lines) and not FENCE.match(lines[k].strip()):
            k += 1
        yield j + 2, mode, lines[j + 1:k]
        i = k + 1


def _joined(lines: List[str]):
    """(offset, command) with backslash continuations joined."""
    buf, start = "", None
    for n, raw in enumerate(lines):
        if start is None:
            start = n
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        yield start, (buf + raw).strip()
        buf, start = "", None


def hostfile_slots(path: Path) -> int:
    total = 0
    for line in path.read_text().splitlines():
        m = re.search(r"slots=(\d+)", line.split("#", 1)[0])
        if m:
            total += int(m.group(1))
    return total


def make_recipes(makefile: Path = ROOT / "Makefile") -> dict:
    """{target: [recipe lines]} of the Makefile (targets with their own recipe)."""
    recipes, target = {}, None
    for line in makefile.read_text().splitlines():
        m = re.match(r"^([\w.-]+):(?!=)", line)
        if m:
            target = m.group(1)
            recipes.setdefault(target, [])
        elif line.startswith("\t") and target:
            recipes[target].append(line.strip())
        elif line.strip() and not line.startswith("#"):
            target = None
    return recipes


def _parse(tokens: List[str], page: str, line: str, e2e: bool) -> Optional[DocCommand]:
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):  # VAR=value prefixes
        tokens = tokens[1:]
    if not tokens:
        return None
    cli_only = any(t in ("--help", "-h", "--cfg", "--info") for t in tokens)
    for module, kind in (("dsrl.main", "main"), ("dsrl.serve", "serve")):
        if module in tokens:
            at = tokens.index(module)
            world = 1
            if "--num_gpus" in tokens[:at]:
                world = int(tokens[tokens.index("--num_gpus") + 1])
            elif "--hostfile" in tokens[:at]:
                world = hostfile_slots(ROOT / tokens[tokens.index("--hostfile") + 1])
            return DocCommand(page, line, kind, tokens[at + 1:], world, e2e=e2e, cli_only=cli_only)
    if tokens[0].endswith("multinode_deepspeed.sh"):
        rest = [t for t in tokens[1:] if not t.startswith("--")]
        return DocCommand(page, line, "main", rest[1:], hostfile_slots(ROOT / rest[0]), e2e=e2e)
    if tokens[0] == "make":
        targets = [t for t in tokens[1:] if "=" not in t and not t.startswith("-")]
        args = next((t.split("=", 1)[1] for t in tokens[1:] if t.startswith("ARGS=")), "")
        cmd = DocCommand(page, line, "make", make_target=targets[0] if targets else "", e2e=e2e)
        for recipe in make_recipes().get(cmd.make_target, []):
            inner = shlex.split(recipe.replace("$(ARGS)", args).replace("$(PY)", "python")
                                .replace("$(VENV)/bin/", ""))
            sub = _parse(inner, page, line, e2e)
            if sub is not None and sub.kind in ("main", "serve"):
                sub.make_target = cmd.make_target
                return sub
        return cmd
    return DocCommand(page, line, "other", e2e=e2e)


def doc_commands() -> List[DocCommand]:
    out = []
    for path in doc_pages():
        rel = str(path.relative_to(ROOT))
        for first, mode, lines in runnable_blocks(path):
            for offset, line in _joined(lines):
                if not line or line.startswith("#"):
                    continue
                cmd = _parse(shlex.split(line, comments=True), f"{rel}:{first + offset}", line, mode == "e2e")
                if cmd is not None:
                    out.append(cmd)
    return out
