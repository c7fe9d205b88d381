"""mlx-spec's ``--draft dflash`` greedy decoding against z-lab's own decode
loop (``dflash.model_mlx.stream_generate``), same drafter weights, same
target checkpoint: the same tokens, both mlx-lm's, with drafts accepted and
rejected in both.

The target is a tiny ``qwen3_5`` (z-lab's loop rolls back GDN layers of that
family only) whose greedy text mostly walks a fixed token cycle
(``write_cycle_checkpoint``, its layers' outputs scaled to 0.1 so that it
leaves the cycle now and then); the drafter (``write_successor_drafter``)
proposes the cycle's successor of the pending token at every block position.
So with a block of 4 a pass accepts one draft (the target followed its cycle)
or none, with a block of 2 all or none: the test asserts, from z-lab's counts,
that each case occurs, and from ours that drafts were accepted and rejected.

Each loop runs on its own load of the checkpoint: z-lab's wraps the target's
layers for good, and mlx-spec's loader gives the GDN layers a verify forward
that z-lab's rollback does not know. Skipped, saying why, without z-lab's
package (``pip install --no-deps dflash==0.1.0``).
"""

import mlx_lm
import pytest
from mlx_lm.models import qwen3_5

import mlx_spec
from mlx_spec import SpecStats
from mlx_spec.models.dflash.capture import detach_tap
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.dflash_drafters import (
    write_dflash_checkpoint,
    write_successor_drafter,
)
from mlx_spec.testing.mtp_heads import cycle_order, write_cycle_checkpoint
from mlx_spec.testing.reference import (
    prompts,
    reference_tokens,
    register_twin,
    spec_tokens,
)

pytest.importorskip(
    "dflash.model_mlx",
    reason="z-lab's dflash package is absent (pip install --no-deps dflash==0.1.0)",
)

from mlx_spec.testing.dflash_reference import (  # noqa: E402 (after the skip)
    reference_draft_model,
    reference_loop_gap,
    run_reference_loop,
)

MAX_TOKENS = 32
# Layer outputs scaled so that the target leaves its cycle a few times in 32
# tokens (measured: 3 of 40 tokens on the mixed prompt).
TARGET_SCALE = 0.1


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    """(ours, z-lab's, mlx-lm's twin, tokenizer, checkpoint directory): three
    loads of one cycle target, no end-of-sequence token."""
    root = tmp_path_factory.mktemp("dflash_loop")
    path = write_cycle_checkpoint(root / "target", "qwen3_5", target_scale=TARGET_SCALE)
    ours, tok = mlx_spec.load(path)
    theirs, their_tok = mlx_lm.load(str(path))
    plain, plain_tok = mlx_lm.load(str(path))
    register_twin(ours, plain)
    for t in (tok, their_tok, plain_tok):
        t.eos_token_ids = set()
    yield ours, theirs, plain, tok, their_tok, root
    detach_tap(ours)


def test_z_labs_loop_runs_on_the_tiny_qwen3_5_target(loads):
    _, theirs, *_ = loads
    assert reference_loop_gap(theirs) == ""


def test_z_labs_loop_cannot_roll_back_our_verify_layers(loads):
    """Why its loop gets its own plain load: the control for the check above."""
    ours, *_ = loads
    assert "GatedDeltaNet" in reference_loop_gap(ours)


def test_z_labs_loop_stops_on_qwen3_next(tmp_path):
    """Why only mlx-spec's loop is checked on qwen3_next: z-lab's stops at its
    first rollback, asserting that every recurrent layer is qwen3_5's."""
    path = write_tiny_checkpoint(tmp_path / "target", "qwen3_next")
    model, tok = mlx_lm.load(str(path))
    assert "Qwen3NextGatedDeltaNet" in reference_loop_gap(model)
    draft, _ = reference_draft_model(
        write_dflash_checkpoint(tmp_path / "drafter", "qwen3_next"), model
    )
    call = qwen3_5.GatedDeltaNet.__call__
    with pytest.raises(AssertionError, match="non-trimmable cache count"):
        run_reference_loop(model, draft, tok, prompts("mixed"), MAX_TOKENS)
    assert qwen3_5.GatedDeltaNet.__call__ is call  # its patch undone


@pytest.mark.parametrize("block_size", [2, 4])
def test_the_same_tokens_as_z_labs_loop(loads, block_size):
    """Both mlx-lm's, with drafts accepted and rejected in each loop. Their
    passes are not aligned (z-lab's prefill yields the first token; our first
    pass verifies the prompt's last token with a block drafted from the rest),
    so the acceptance is checked in each, not compared pass by pass."""
    ours, theirs, plain, tok, their_tok, root = loads
    drafter_dir = write_successor_drafter(
        root / f"drafter{block_size}", plain, block_size=block_size
    )
    draft, _ = reference_draft_model(drafter_dir, theirs)
    passes, stats = [], SpecStats()
    for prompt in (prompts("mixed"), [7], cycle_order()[:6]):
        want = reference_tokens(ours, tok, prompt, MAX_TOKENS)
        run = run_reference_loop(theirs, draft, their_tok, prompt, MAX_TOKENS)
        got = spec_tokens(
            ours,
            tok,
            prompt,
            MAX_TOKENS,
            draft_model=str(drafter_dir),
            num_draft_tokens=block_size - 1,
            stats=stats,
        )
        assert run.tokens == want, prompt
        assert got == want, prompt
        passes += zip(run.accepted, run.drafted)
    # z-lab's loop: every draft rejected, some accepted, both in one block
    assert any(a == 0 for a, _ in passes)
    if block_size == 2:
        assert any(a == d == 1 for a, d in passes)
    else:
        assert any(0 < a < d for a, d in passes)
    # ours
    assert 0 < stats.accepted < stats.drafted
