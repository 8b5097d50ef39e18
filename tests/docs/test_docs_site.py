"""The documentation cannot drift from the code unnoticed: the generated configuration reference
covers every schema field (as the schema's dataclasses list them, not as the generator parses them),
the build's config-key check rejects a key the schema lacks, and the README stays a front page."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from dsrl.config import schema

DOCS = Path(__file__).resolve().parents[2] / "docs"
sys.path.insert(0, str(DOCS))
import gen_config_ref  # noqa: E402  (docs/gen_config_ref.py)

pytest.importorskip("mkdocs")
import hooks  # noqa: E402  (docs/hooks.py, which imports mkdocs)


def _schema_keys(cls, prefix=""):
    """Every leaf key of the schema, from the dataclasses themselves."""
    hints = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for name, f in hints.items():
        key = f"{prefix}.{name}" if prefix else name
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out += _schema_keys(type(default), key)
        else:
            out.append(key)
    return out


def test_reference_covers_every_schema_field():
    keys = _schema_keys(schema.Config)
    assert len(keys) > 150
    page = gen_config_ref.render()
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert not missing, f"schema keys missing from the configuration reference: {missing}"
    generated = [f.key for f in gen_config_ref.all_fields()]
    assert sorted(generated) == sorted(keys) and len(set(generated)) == len(generated)  # nothing extra, none twice


def test_reference_gives_type_default_and_comment():
    fields = {f.key: f for f in gen_config_ref.all_fields()}
    lr = fields["actor.lr"]
    assert (lr.type, lr.default, lr.comment) == ("float", "1.0e-5", "AdamW learning rate.")
    assert fields["actor.lora.target_modules"].default.startswith('["q_proj"')
    # A field without a comment of its own shares the one right above it.
    assert fields["algo.mis_upper"].comment == fields["algo.mis_lower"].comment == "MIS ratio bounds."
    assert "+exp=grpo_reuse" in gen_config_ref.preset_keys()["algo.reuse_logprobs"]


def test_key_check_rejects_a_key_the_schema_lacks():
    page = ("Set `algo.use_tis=true` and `actor.lora.{rank,alpha}`; the file `dsrl/stages/rollout.py`.\n"
            "```bash\npython -m dsrl.main algo.off_policy_step=2 +algo.loss_fn_config.anything=1 \\\n"
            "    rollout.sync_tolerance=1e-3\n```\n`trainer.resume_from_dir` and `algo.mis_*` and `algo.nope_*`\n")
    errors = hooks.check_page(page)
    assert len(errors) == 3, errors
    assert "has no key 'off_policy_step'" in errors[0]
    assert "has no key 'resume_from_dir'" in errors[1]
    assert "algo.nope_*" in errors[2]


def test_readme_is_a_front_page():
    readme = (DOCS.parent / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "make test" in readme and "LICENSE" in readme
