"""attention=document (utils/model/gpt_neox.py): in a packed sequence each token attends only within its own
document; with position_reset its rotary positions restart there. Checked against the plain causal model run
on each document alone, and FlexAttention's block mask against SDPA's dense one."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from configs import get_model_spec
from utils.model import build_model
from utils.model.common.masks import document_ids, positions_in_documents

SPEC = replace(get_model_spec("tiny"), num_hidden_layers=2, max_position_embeddings=64)
EOS = 0


def doc(n: int, seed: int) -> torch.Tensor:
    """A document of n tokens (no EOS inside) followed by EOS."""
    body = torch.randint(1, SPEC.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([body, torch.tensor([EOS])])


def masked_model(position_reset: bool, flex: bool = False):
    model = build_model(SPEC, seed=1)
    model.use_document_masking(EOS, position_reset=position_reset, flex=flex)
    return model.eval()


def test_document_ids_and_positions():
    ids = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9]])
    assert document_ids(ids, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    assert positions_in_documents(document_ids(ids, EOS)).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


@torch.no_grad()
def test_a_document_in_a_pack_has_its_logits_alone_with_position_reset():
    a, b, c = doc(9, 1), doc(12, 2), doc(20, 3)
    packed = torch.cat([a, b, c])[None]
    plain = build_model(SPEC, seed=1).eval()
    logits = masked_model(position_reset=True).logits(packed)[0]
    start = len(a)
    alone = plain.logits(b[None])[0]
    assert torch.allclose(logits[start:start + len(b)], alone, atol=1e-5, rtol=0)
    assert torch.allclose(logits[:len(a)], plain.logits(a[None])[0], atol=1e-5, rtol=0)
    # without masking the same document sees the one before it
    unmasked = plain.logits(packed)[0]
    assert not torch.allclose(unmasked[start:start + len(b)], alone, atol=1e-3)


@torch.no_grad()
def test_without_position_reset_a_document_depends_only_on_itself_at_its_offset():
    b = doc(12, 2)
    one_before = torch.cat([doc(9, 4), b, doc(5, 5)])[None]  # b at offset 10 after one document ...
    two_before = torch.cat([doc(4, 6), doc(4, 7), b, doc(5, 8)])[None]  # ... and after two others
    model = masked_model(position_reset=False)
    x, y = model.logits(one_before)[0, 10:10 + len(b)], model.logits(two_before)[0, 10:10 + len(b)]
    assert torch.allclose(x, y, atol=1e-5, rtol=0)
    # rotary attention scores depend only on relative positions, so within a document the offset changes
    # nothing but rounding: what position_reset changes is numerics (and the positions a model sees)
    elsewhere = model.logits(torch.cat([doc(3, 9), b])[None])[0, 4:4 + len(b)]
    assert torch.allclose(elsewhere, x, atol=1e-4, rtol=0)


@torch.no_grad()
def test_the_first_token_after_an_eos_does_not_see_the_previous_document():
    b = doc(6, 2)
    model = masked_model(position_reset=False)
    losses = []
    for seed in (11, 12):  # two different previous documents of the same length
        packed = torch.cat([doc(7, seed), b])[None]
        logits = model.logits(packed)[0]
        first = 8  # b's first token; its prediction is of b's second token
        losses.append(torch.nn.functional.cross_entropy(logits[first:first + 1], packed[0, first + 1:first + 2]))
    assert torch.equal(losses[0], losses[1])


@pytest.mark.parametrize("position_reset", [False, True])
@torch.no_grad()
def test_flex_attention_block_mask_matches_the_dense_mask(position_reset):
    """Forward only: FlexAttention has no backward on the CPU (the CUDA path, with gradients, is in
    tests/e2e/test_gpu.py)."""
    packed = torch.cat([doc(9, 1), doc(12, 2), doc(20, 3)])[None].repeat(2, 1)
    dense, flex = masked_model(position_reset, flex=False), masked_model(position_reset, flex=True)
    assert torch.allclose(dense.logits(packed), flex.logits(packed), atol=1e-5, rtol=0)
    assert torch.allclose(dense(packed), flex(packed), atol=1e-6)


def test_document_masking_trains_under_activation_checkpointing_with_the_same_gradients():
    from utils.model.activation_checkpointing import apply_activation_checkpointing

    packed = torch.cat([doc(9, 1), doc(12, 2), doc(20, 3)])[None]
    plain, wrapped = masked_model(True).train(), masked_model(True).train()
    apply_activation_checkpointing(wrapped, "selective")
    plain(packed).backward()
    wrapped(packed).backward()
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_document_masking_through_train_py_matches_on_one_and_two_processes_ddp_and_fsdp(tmp_path, subprocess_env):
    """attention=document end to end: 2 DDP ranks and 2 FSDP ranks give the losses of one process with the
    same global batch (1e-5), and the masking changes the loss (the shards' token 0 ends documents)."""
    import math

    from tests.trainkit import REPO_ROOT, TINY, make_shards, run, train_cmd, train_rows

    data = make_shards(tmp_path / "data")
    sets = ("attention=document", "eos_id=0", "position_reset=true", "max_steps=4", "save_steps=4")

    def launch(out, strategy):
        cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", "2", "--strategy", strategy,
               "--", "--output-dir", str(out), "--data-dir", str(data)]
        for s in TINY + list(sets) + ["per_device_train_batch_size=2"]:
            cmd += ["--set", s]
        return run(cmd, subprocess_env, timeout=600)

    one = run(train_cmd(tmp_path / "one", data, *sets, "per_device_train_batch_size=4"), subprocess_env)
    assert "attention: document (tokens attend within their own document; EOS id 0" in one.stdout
    launch(tmp_path / "ddp", "ddp")
    launch(tmp_path / "fsdp", "fsdp")
    causal = tmp_path / "causal"
    run(train_cmd(causal, data, "max_steps=1", "save_steps=4", "per_device_train_batch_size=4"), subprocess_env)
    ref = train_rows(tmp_path / "one")
    for other in ("ddp", "fsdp"):
        rows = train_rows(tmp_path / other)
        assert sorted(rows) == [1, 2, 3, 4]
        for step in rows:
            assert math.isclose(rows[step]["loss"], ref[step]["loss"], rel_tol=1e-5), (other, step)
    assert abs(train_rows(causal)[1]["loss"] - ref[1]["loss"]) > 1e-4


def test_an_eos_id_beyond_the_vocabulary_is_one_line(tmp_path, subprocess_env):
    """attention=document with eos_id past the model's vocabulary (it was accepted: no document ever ended)."""
    from tests.trainkit import make_shards, run, train_cmd

    data = make_shards(tmp_path / "data", n_files=2, rows=8)
    proc = run(train_cmd(tmp_path / "out", data, "attention=document", "eos_id=100000", "max_steps=2"),
               subprocess_env, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and "eos_id is 100000, not a token id of the model's vocabulary" in errors[0], errors
