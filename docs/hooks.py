"""MkDocs hooks (mkdocs.yml `hooks:`): the pages made at build time, and the config-key check.

- `reference/configuration.md` is generated from dsrl/config/schema.py (docs/gen_config_ref.py),
  `index.md` is README.md (its links into docs/ made relative);
  `changelog.md` and `contributing.md` are the repository's CHANGELOG.md and CONTRIBUTING.md.
- Every config key a page names in code (inline `algo.use_tis=true` or a fenced command line) must
  exist in the schema: a key that does not is a warning naming the page and the key, and
  `mkdocs build --strict` (`make docs`) fails on it.
"""
from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_config_ref  # noqa: E402  (docs/gen_config_ref.py)

log = logging.getLogger("mkdocs.hooks.dsrl")
ROOT = gen_config_ref.ROOT
# Pages that are files of the repository's root, shown on the site under these names.
ROOT_PAGES = {"changelog.md": "CHANGELOG.md", "contributing.md": "CONTRIBUTING.md"}
# A final part that makes a dotted word a file name, not a key (`rollout.py`, `model.safetensors`).
FILE_EXTS = {"py", "yaml", "yml", "sh", "md", "json", "jsonl", "log", "txt", "png", "safetensors",
             "toml", "sbatch", "parquet", "html", "bin"}
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")


def site_links(text: str) -> str:
    """A root file's Markdown as a site page: its links into docs/ made relative to the site."""
    text = text.replace("](docs/", "](")
    for page, source in ROOT_PAGES.items():
        text = text.replace(f"]({source})", f"]({page})")
    return re.sub(r"\[([^\]]+)\]\(LICENSE\)", r"\1 (the file `LICENSE`)", text)


def _put(files, config, src_uri: str, content: str) -> None:
    """A generated page; it replaces the file of that name in docs/ (a pointer for readers of the
    repository, such as docs/reference/configuration.md)."""
    old = files.get_file_from_path(src_uri)
    if old is not None:
        files.remove(old)
    files.append(File.generated(config, src_uri, content=content))


def on_files(files, config):
    _put(files, config, "reference/configuration.md", gen_config_ref.render())
    _put(files, config, "index.md", site_links((ROOT / "README.md").read_text()))
    for page, source in ROOT_PAGES.items():
        _put(files, config, page, site_links((ROOT / source).read_text()))
    return files


def _expand(word: str) -> list:
    """`actor.lora.{rank,alpha}` -> [actor.lora.rank, actor.lora.alpha]."""
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    return [w for part in m.group(1).split(",")
            for w in _expand(word[:m.start()] + part.strip() + word[m.end():])]


def config_keys_in(text: str, groups) -> list:
    """The dotted config keys that the code spans and fenced blocks of `text` name."""
    code = [m.group(0) for m in FENCE.finditer(text)]
    prose = FENCE.sub("", text)
    code += [m.group(1) for m in INLINE.finditer(prose)]
    word = re.compile(r"(?<![\w./$-])\+{0,2}~?((?:%s)\.[A-Za-z_{][\w{},]*(?:\.[A-Za-z_{][\w{},]*)*\*?)"
                      % "|".join(map(re.escape, groups)))
    keys = []
    for chunk in code:
        for m in word.finditer(chunk):
            for key in _expand(m.group(1).rstrip(".,")):
                if key.rsplit(".", 1)[-1] in FILE_EXTS:
                    continue
                keys.append(key)
    return keys


def check_page(text: str) -> list:
    """One message per config key the page names that the schema does not have."""
    groups = gen_config_ref.top_groups()
    errors = []
    for key in dict.fromkeys(config_keys_in(text, groups)):
        why = gen_config_ref.resolve_key(key)
        if why and key.endswith("*"):  # `algo.mis_*`: some key of the group starts so
            group, _, prefix = key[:-1].rpartition(".")
            if any(f.key.startswith(f"{group}.{prefix}") for f in gen_config_ref.all_fields()):
                why = None
        if why:
            errors.append(why)
    return errors


def on_page_markdown(markdown, page, config, files):
    for why in check_page(markdown):
        log.warning("%s: config key not in the schema: %s", page.file.src_uri, why)
    return markdown
