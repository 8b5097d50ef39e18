"""Chat template encoding with the real SmolLM2 tokenizer (from the tiny model folder)."""
from dsrl.data import (apply_chat_template, encode_prompts, make_source, plain_prompt_text,
                       render_prompt, user_prompt)


def test_chat_template_markers(tiny_tokenizer):
    tok = tiny_tokenizer
    p = user_prompt("What is 3 + 5? Answer with just the number.", "8")
    ids = apply_chat_template(tok, p, "")
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    start = tok.convert_tokens_to_ids("<|im_start|>")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(start) == 3 and ids.count(end) == 2  # system, user, open assistant turn
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")  # generation prompt
    assert "<|im_start|>user\nWhat is 3 + 5?" in text
    assert render_prompt(tok, p) == text


def test_system_prompt_replaces_default(tiny_tokenizer):
    tok = tiny_tokenizer
    p = user_prompt("What is 1 + 1?", "2")
    text = tok.decode(apply_chat_template(tok, p, "Be brief."))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert "SmolLM" not in text


def test_plain_fallback(tiny_tokenizer):
    tok = tiny_tokenizer
    p = user_prompt("What is 1 + 1?", "2")
    ids = apply_chat_template(tok, p, "Be brief.", chat_template=False)
    assert tok.convert_tokens_to_ids("<|im_start|>") not in ids
    assert tok.decode(ids) == "Be brief.\n\nWhat is 1 + 1?\n" == plain_prompt_text(p, "Be brief.")


def test_encode_batch(tiny_tokenizer):
    prompts = make_source("arith").eval_set(4)
    batch = encode_prompts(tiny_tokenizer, prompts)
    assert len(batch) == 4 and all(b[-3:] == batch[0][-3:] for b in batch)
