"""The configuration reference, generated from dsrl/config/schema.py and conf/.

Read by the MkDocs hook (docs/hooks.py) at build time, and by tests/docs. The schema is parsed
with `ast` (nothing of dsrl is imported): every dataclass field gives its dotted key, its type
and default as written in the source, and the comment lines written right above it (a field with
no comment of its own shares the comment of the field right before it, as `mis_lower` /
`mis_upper` do). The presets column lists the `conf/exp` presets and the `conf/<group>` options
that set the key.

    python docs/gen_config_ref.py > /tmp/configuration.md    # the page, printed
"""
from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "dsrl" / "config" / "schema.py"
CONF = ROOT / "conf"
TOP = "Config"  # the root dataclass: its fields are the top-level groups


@dataclass
class Field:
    key: str            # dotted: "actor.lora.rank"
    type: str           # as annotated: "int", "Optional[str]"
    default: str        # as written: "1.0e-5", "[0.9, 0.999]"
    comment: str        # the comment lines above the field, joined
    nested: Optional[str] = None  # the dataclass it holds, for a sub-section
    is_mapping: bool = False      # a dict: any key below it is the user's


@dataclass
class Group:
    key: str            # "actor", "actor.lora", or "" for the root's plain fields
    cls: str
    doc: str            # the class docstring, or the comment above the field that holds it
    fields: List[Field]


def _comment_above(lines: List[str], lineno: int) -> List[str]:
    """The `#` lines right above line `lineno` (1-based), top to bottom."""
    out = []
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        out.append(lines[i].strip().lstrip("#").strip())
        i -= 1
    return list(reversed(out))


class _Source:
    """ast.get_source_segment without its per-call re-split of the whole file."""

    def __init__(self, text: str):
        self.lines = text.splitlines(keepends=True)

    def __call__(self, node: ast.AST) -> str:
        first, last = node.lineno - 1, node.end_lineno - 1
        if first == last:
            return self.lines[first].encode()[node.col_offset:node.end_col_offset].decode()
        parts = [self.lines[first].encode()[node.col_offset:].decode(), *self.lines[first + 1:last],
                 self.lines[last].encode()[:node.end_col_offset].decode()]
        return "".join(parts)


def _default_text(seg: _Source, value: Optional[ast.expr]) -> Tuple[str, Optional[str]]:
    """(default as written, nested dataclass name or None)."""
    if value is None:
        return "(required)", None
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        for kw in value.keywords:
            if kw.arg == "default_factory":
                if isinstance(kw.value, ast.Name):
                    name = kw.value.id
                    if name in ("dict", "list"):
                        return "{}" if name == "dict" else "[]", None
                    return "", name
                if isinstance(kw.value, ast.Lambda):
                    return " ".join(seg(kw.value.body).split()), None
            if kw.arg == "default":
                return seg(kw.value), None
    return seg(value), None


@functools.lru_cache(maxsize=None)
def parse_schema(path: Path = SCHEMA) -> Dict[str, Tuple[str, List[Tuple[Field, int]]]]:
    """{class name: (docstring, [(field with its own key only, line)])} for every dataclass."""
    src = path.read_text()
    lines = src.splitlines()
    seg = _Source(src)
    classes = {}
    for node in ast.parse(src).body:
        if not isinstance(node, ast.ClassDef):
            continue
        doc = ast.get_docstring(node) or ""
        fields, prev_comment = [], ""
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            comment_lines = _comment_above(lines, stmt.lineno)
            prev_line = lines[stmt.lineno - 2].strip() if stmt.lineno >= 2 else ""
            if comment_lines:
                comment = " ".join(comment_lines)
            elif prev_line and not prev_line.startswith("#") and fields:
                comment = prev_comment  # shares the comment of the field right before it
            else:
                comment = ""
            prev_comment = comment
            default, nested = _default_text(seg, stmt.value)
            typ = seg(stmt.annotation)
            fields.append((Field(stmt.target.id, typ, default, comment, nested,
                                 is_mapping=typ in ("dict", "Dict", "Any") or typ.startswith("Dict[")),
                           stmt.lineno))
        classes[node.name] = (doc, fields)
    return classes


def schema_groups(path: Path = SCHEMA) -> List[Group]:
    """The schema as sections: the root's plain fields, then each group and its nested groups."""
    classes = parse_schema(path)
    groups: List[Group] = []

    def walk(cls: str, prefix: str, doc: str) -> None:
        own = []
        subs = []
        for f, _ in classes[cls][1]:
            key = f"{prefix}.{f.key}" if prefix else f.key
            item = Field(key, f.type, f.default, f.comment, f.nested, f.is_mapping)
            if f.nested and f.nested in classes:
                subs.append(item)
            own.append(item)
        if own and prefix:
            groups.append(Group(prefix, cls, doc, [f for f in own if not f.nested]))
        elif not prefix:
            groups.append(Group("", cls, doc, [f for f in own if not f.nested]))
        for item in subs:
            walk(item.nested, item.key, classes[item.nested][0] or item.comment)

    walk(TOP, "", classes[TOP][0])
    return groups


@functools.lru_cache(maxsize=None)
def all_fields(path: Path = SCHEMA) -> List[Field]:
    return [f for g in schema_groups(path) for f in g.fields]


def top_groups(path: Path = SCHEMA) -> List[str]:
    """Top-level keys that hold a dataclass: model, actor, rollout, ..."""
    classes = parse_schema(path)
    return [f.key for f, _ in classes[TOP][1] if f.nested]


def resolve_key(dotted: str, path: Path = SCHEMA) -> Optional[str]:
    """None when `dotted` names a schema key (or a key under a dict field, or a sub-group); else
    the reason it does not."""
    classes = parse_schema(path)
    cls = TOP
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = {f.key: f for f, _ in classes[cls][1]}
        if part not in fields:
            where = ".".join(parts[:i]) or "the root"
            return f"`{dotted}`: {where} ({cls} in dsrl/config/schema.py) has no key {part!r}"
        f = fields[part]
        if f.is_mapping:
            return None  # the user's own keys below a dict field
        if f.nested:
            cls = f.nested
            continue
        if i != len(parts) - 1:
            return f"`{dotted}`: {'.'.join(parts[:i + 1])} is a {f.type}, not a group"
    return None


def _flatten(node, prefix: str) -> List[str]:
    if isinstance(node, dict):
        out = []
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            out.extend(_flatten(v, key) if isinstance(v, dict) and v else [key])
        return out
    return [prefix]


def _group_defaults(conf: Path) -> Dict[str, str]:
    """{group: its default option} from conf/config.yaml's defaults list."""
    import yaml

    out = {}
    for item in (yaml.safe_load((conf / "config.yaml").read_text()) or {}).get("defaults", []):
        if isinstance(item, dict):
            out.update({str(k): str(v) for k, v in item.items()})
    return out


def _yaml_values(path: Path) -> Dict[str, object]:
    """{dotted key: value} that one conf file sets (a `_global_` file at the root, else under its group)."""
    import yaml

    text = path.read_text()
    data = yaml.safe_load(text) or {}
    data.pop("defaults", None)
    data.pop("hydra", None)
    prefix = "" if "@package _global_" in text.split("\n", 1)[0] else path.parent.name
    out = {}

    def walk(node, key):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        else:
            out[key] = node

    walk(data, prefix)
    return out


def preset_keys(conf: Path = CONF) -> Dict[str, List[str]]:
    """{dotted key: [how to select a file that sets it]}: `+exp=NAME` for conf/exp, `GROUP=NAME` for
    a config group's other options (the group's default file, which restates the defaults, is left out)."""
    defaults = _group_defaults(conf)
    out: Dict[str, List[str]] = {}
    for path in sorted(conf.glob("*/*.yaml")):
        group, name = path.parent.name, path.stem
        if defaults.get(group) == name:
            continue
        label = f"+exp={name}" if group == "exp" else f"{group}={name}"
        for key in _yaml_values(path):
            if key != "name":
                out.setdefault(key, []).append(label)
    return out


def conf_defaults(conf: Path = CONF) -> Dict[str, object]:
    """{dotted key: value} that the default config-group files set (conf/config.yaml's defaults)."""
    out = {}
    for group, name in _group_defaults(conf).items():
        path = conf / group / f"{name}.yaml"
        if path.exists():
            out.update(_yaml_values(path))
    return out


def _same(schema_default: str, value: object) -> bool:
    try:
        return ast.literal_eval(schema_default) == value
    except (ValueError, SyntaxError):
        return schema_default == str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(path: Path = SCHEMA, conf: Path = CONF) -> str:
    """The configuration reference page (Markdown)."""
    presets = preset_keys(conf)
    group_defaults = conf_defaults(conf)
    lines = [
        "# Configuration reference",
        "",
        "Generated at build time from `dsrl/config/schema.py` (every key, its type and default as the",
        "schema writes them, the comment above it) and from `conf/` (which preset or config-group file",
        "sets it). A key added to the schema appears here without anyone editing this page. Where a",
        "default config-group file (`conf/config.yaml`'s defaults list) sets another value than the",
        "schema's, the default column gives both: the `conf:` value is what a run gets.",
        "",
        "Set a key on the command line (`python -m dsrl.main +exp=grpo_reuse actor.lr=2e-5`), in a preset",
        "under `conf/exp/`, or in a config group file. An unknown key or a value of the wrong type fails",
        "before any model loads, naming the key; `+exp=NAME` selects the preset `conf/exp/NAME.yaml`;",
        "`data=jsonl` selects the file `conf/data/jsonl.yaml`. Keys under a `dict` (such as",
        "`algo.loss_fn_config`) are added with a leading `+`: `+algo.loss_fn_config.clip_high_threshold=1.3`.",
        "",
    ]
    for g in schema_groups(path):
        if not g.fields:
            continue
        title = g.key or "Top level"
        lines += [f"## `{g.key}`" if g.key else f"## {title}", ""]
        if g.doc:
            lines += [" ".join(g.doc.split()), ""]
        lines += ["| key | type | default | meaning | set by |", "|---|---|---|---|---|"]
        for f in g.fields:
            setters = ", ".join(f"`{s}`" for s in presets.get(f.key, []))
            default = f"`{_cell(f.default)}`"
            if f.key in group_defaults and not _same(f.default, group_defaults[f.key]):
                default += f" (conf: `{_cell(repr(group_defaults[f.key]))}`)"
            lines.append(f"| `{f.key}` | `{_cell(f.type)}` | {default} | {_cell(f.comment)} | {setters} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
