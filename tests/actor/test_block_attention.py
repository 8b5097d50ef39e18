"""Block attention of shared-prompt rows (dsrl.actor.block_attention): the blocks by hand, and the
tiny Llama's forward and gradients by blocks against the same row under its 4-D mask (eager and
sdpa, float32), with the block path proven to run (and to matter: wrong blocks change the output)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from dsrl.actor.batch import Sample
from dsrl.actor.block_attention import BLOCKS_KEY, attention_by_blocks, blocks_pay_off, build_blocks
from dsrl.actor.shared_prompt import additive_mask, collate_shared_prompt

PAD = 0


def test_blocks_by_hand():
    # row 0: prompt at 0..2, responses at 3..4 and 5; row 1 (L = 6): prompt at 0..1, response at 2..4
    blocks = build_blocks([(0, 0, 0, 0, 3), (0, 0, 3, 3, 2), (0, 0, 3, 5, 1), (1, 0, 0, 0, 2), (1, 0, 2, 2, 3)], 6)
    prompts, responses = blocks
    assert prompts["q_index"].tolist() == [[0, 1, 2], [6, 7, 0]]
    assert prompts["k_index"].tolist() == [[0, 1, 2], [6, 7, 0]]
    assert prompts["q_valid"].tolist() == [[True, True, True], [True, True, False]]
    assert prompts["allowed"][1, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 0]]  # padded query: key 0
    assert responses["q_index"].tolist() == [[3, 4, 0], [5, 0, 0], [8, 9, 10]]
    assert responses["k_index"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 5, 0], [6, 7, 8, 9, 10]]
    assert responses["allowed"][0, 0].int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert responses["allowed"][1, 0].int().tolist() == [[1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]
    assert responses["allowed"][2, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def _s(prompt, resp, index, group):
    return Sample(prompt_ids=list(prompt), response_ids=list(resp), group=group, index=index,
                  rollout_log_probs=[0.0] * len(resp))


def _batch():
    """Two runs with prompts of 7 and 4 tokens, responses of 1-9 tokens; the short run shares a row."""
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(5, 400, (n,), generator=g).tolist()
    p0, p1 = ids(7), ids(4)
    samples = [_s(p0, ids(9), 0, 0), _s(p0, ids(1), 1, 0), _s(p0, ids(5), 2, 0), _s(p0, ids(8), 3, 0),
               _s(p1, ids(3), 4, 1), _s(p1, ids(6), 5, 1)]
    return collate_shared_prompt(samples, PAD)


def _forward(model, mb, by_blocks: bool):
    """Hidden-state outputs at every real position of the row (padding excluded), and the
    gradient of a fixed random projection of them with respect to every parameter."""
    model.zero_grad(set_to_none=True)
    mask = additive_mask(mb["attention_mask"], torch.float32)
    with attention_by_blocks(model) if by_blocks else _null() as on:
        assert on is by_blocks or not by_blocks
        kwargs = {"dsrl_blocks": mb[BLOCKS_KEY]} if by_blocks else {}
        out = model(input_ids=mb["input_ids"], attention_mask=mask, position_ids=mb["position_ids"],
                    use_cache=False, **kwargs).logits
    real = torch.zeros(mb["input_ids"].shape, dtype=torch.bool)
    for blk in mb[BLOCKS_KEY]:
        real.view(-1)[blk["q_index"][blk["q_valid"]]] = True
    picked = out[real]
    weights = torch.randn(picked.shape, generator=torch.Generator().manual_seed(1))
    (picked * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return picked.detach(), grads


class _null:
    def __enter__(self):
        return False

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_block_attention_equals_the_masked_row_forward_and_gradients(tiny_model_path, attn, block_attention_calls):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32, attn_implementation=attn)
    model.train()
    mb = _batch()
    calls = block_attention_calls
    masked, masked_grads = _forward(model, mb, by_blocks=False)
    assert calls == []
    blocks, block_grads = _forward(model, mb, by_blocks=True)
    assert calls == [attn == "sdpa"] * model.config.num_hidden_layers  # every layer ran by blocks
    assert model.config._attn_implementation == attn  # restored on exit
    torch.testing.assert_close(blocks, masked, atol=2e-5, rtol=1e-5)
    assert masked_grads.keys() == block_grads.keys() and len(masked_grads) == len(list(model.parameters()))
    for name, g in masked_grads.items():  # float32 rounding of other matmul shapes: ~3e-7 of the largest entry
        worst = float((block_grads[name] - g).abs().max() / g.abs().max())
        assert worst < 1e-5, f"{name}: max |delta grad| is {worst:.2e} of its largest entry"

    # The blocks are the mask: letting a response block also see the other runs' keys changes the output.
    wrong = [dict(b) for b in mb[BLOCKS_KEY]]
    wrong[1]["allowed"] = torch.ones_like(wrong[1]["allowed"])
    leaked, _ = _forward(model, {**mb, BLOCKS_KEY: wrong}, by_blocks=True)
    assert (leaked - masked).abs().max() > 1e-3


def test_gradient_checkpointing_keeps_the_masked_row(tiny_model_path):
    """The recompute in the backward runs outside the context: no blocks then, so none at all."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32, attn_implementation="eager")
    model.gradient_checkpointing_enable()
    with attention_by_blocks(model) as on:
        assert on is False
        assert model.config._attn_implementation == "eager"


def _group(plen, n, rlen):
    prompt = list(range(10, 10 + plen))
    return [_s(prompt, list(range(500, 500 + rlen)), i, 0) for i in range(n)]


def test_blocks_pay_off_for_long_responses_only():
    """The default job's shape (43-token prompt, 8 x 16 tokens) keeps the masked row; 4 and 8
    responses of 256 tokens after 150 attend by blocks (the measured points of MIN_RATIO/MIN_SAVED)."""
    assert not blocks_pay_off(collate_shared_prompt(_group(43, 8, 16), PAD))
    assert blocks_pay_off(collate_shared_prompt(_group(150, 4, 256), PAD))
    assert blocks_pay_off(collate_shared_prompt(_group(150, 8, 256), PAD))
    assert not blocks_pay_off(collate_shared_prompt(_group(150, 1, 256), PAD))  # one response: nothing masked
