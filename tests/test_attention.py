"""The learner's attention choice (``learner/attention.py``): every branch of the selection, the
packing layout each choice gets, and on this CPU what transformers really does without a mask."""

from __future__ import annotations

import pytest
import torch

from learner.attention import Attention, flash_attn_importable, select_attention
from learner.config import LearnerConfig
from learner.packing import block_causal_mask, packed_completion_logprobs
from learner.worker import packing_layout
from tests.reference_batch import packed
from tests.test_packing import PAD, SHAPES, _random_seqs, _unpadded_logprobs
from tests.tolerance import PACKED_LOGPROB_ATOL

GPU_BF16 = dict(cuda=True, flash_attn=True, dtype="bfloat16")

# --------------------------------------------------------------------------- selection


def test_auto_takes_flash_attention_2_where_it_can_run():
    assert select_attention("auto", **GPU_BF16) == Attention("flash_attention_2", varlen=True)
    assert select_attention("auto", cuda=True, flash_attn=True, dtype="float16").varlen


@pytest.mark.parametrize(
    "missing",
    [dict(cuda=False), dict(flash_attn=False), dict(dtype="float32"), dict(cuda=False, flash_attn=False)],
    ids=["no-cuda", "no-flash-attn", "float32", "cpu-only"],
)
def test_auto_falls_back_to_sdpa_with_a_dense_mask(missing):
    choice = select_attention("auto", **{**GPU_BF16, **missing})
    assert choice == Attention("sdpa", varlen=False) and choice.mask == "bool"


def test_the_start_up_line_says_which_kernel_runs_and_why_auto_fell_back_on_a_gpu():
    # what a rank prints at start-up (learner/worker.py's ready line): the kernel and its mask, and on a GPU
    # without flash-attn the reason and the command that installs it (review B6: sdpa ran unannounced)
    assert select_attention("auto", **GPU_BF16).describe() == "flash_attention_2 attention (none mask)"
    assert select_attention("auto", **{**GPU_BF16, "flash_attn": False}).describe() == (
        "sdpa attention (bool mask; auto: flash_attn does not import: pip install -e '.[flash]' --no-build-isolation)"
    )
    on_fp32 = select_attention("auto", **{**GPU_BF16, "dtype": "float32"}).describe()
    assert on_fp32 == "sdpa attention (bool mask; auto: model.dtype is float32, not bfloat16/float16)"
    assert select_attention("auto", cuda=False, flash_attn=False, dtype="float32").describe() == (
        "sdpa attention (bool mask)"  # a CPU has nothing to choose
    )
    assert select_attention("eager", **GPU_BF16).describe() == "eager attention (additive mask)"  # asked for


def test_forced_flash_attention_2_runs_where_it_can():
    assert select_attention("flash_attention_2", **GPU_BF16) == Attention("flash_attention_2", varlen=True)


@pytest.mark.parametrize(
    "missing,named",
    [
        (dict(cuda=False), ["no CUDA GPU"]),
        (dict(flash_attn=False), ["flash_attn does not import"]),
        (dict(dtype="float32"), ["model.dtype is float32"]),
        (dict(cuda=False, flash_attn=False, dtype="float32"), ["no CUDA GPU", "flash_attn", "model.dtype is float32"]),
    ],
    ids=["no-cuda", "no-flash-attn", "float32", "nothing"],
)
def test_forced_flash_attention_2_that_cannot_run_says_why_in_one_line(missing, named):
    with pytest.raises(ValueError) as err:
        select_attention("flash_attention_2", **{**GPU_BF16, **missing})
    message = str(err.value)
    assert "\n" not in message and message.startswith("learner.attention=flash_attention_2 cannot run here")
    assert all(part in message for part in named) and "learner.attention=auto" in message


@pytest.mark.parametrize("impl,mask", [("sdpa", "bool"), ("eager", "additive")])
def test_forced_dense_kernels_are_taken_as_asked_even_on_a_gpu(impl, mask):
    choice = select_attention(impl, **GPU_BF16)
    assert choice == Attention(impl, varlen=False) and choice.mask == mask


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="choose one of auto, flash_attention_2, sdpa, eager"):
        select_attention("flash", **GPU_BF16)


def test_the_config_key_defaults_to_auto_and_rejects_other_names():
    from launch.config import ConfigError, load_config

    base = ["model.path=x", "data.prompts=x", "reward.function=x"]
    assert load_config(None, base).learner.attention == "auto"
    assert load_config(None, [*base, "learner.attention=eager"]).learner.attention == "eager"
    with pytest.raises(ConfigError, match="learner.attention"):
        load_config(None, [*base, "learner.attention=flash"])


def test_this_cpu_machine_gets_the_dense_path():
    # what LearnerWorker.setup computes here: no CUDA, so sdpa with the boolean block mask
    cuda = torch.cuda.is_available()
    if cuda:
        pytest.skip("a CUDA machine")
    assert select_attention("auto", cuda, cuda and flash_attn_importable(), "bfloat16") == Attention("sdpa", False)


# --------------------------------------------------------------------------- the layout each choice packs with


def test_varlen_packs_one_row_without_a_mask_whatever_pack_row_tokens_says():
    learner = LearnerConfig(pack_row_tokens=512, logprob_chunk_tokens=256)
    layout = packing_layout(Attention("flash_attention_2", varlen=True), learner, "bfloat16", 7, "cpu")
    assert (layout.mask_dtype, layout.row_tokens, layout.pad_id, layout.logprob_chunk) == (None, 0, 7, 256)


@pytest.mark.parametrize(
    "impl,dtype,mask_dtype",
    [("sdpa", "float32", torch.bool), ("sdpa", "bfloat16", torch.bool), ("eager", "float32", torch.float32)]
    + [("eager", "bfloat16", torch.bfloat16)],
)
def test_dense_kernels_keep_the_row_layout_and_their_mask_form(impl, dtype, mask_dtype):
    for rows in (None, 0, 300):
        layout = packing_layout(Attention(impl, varlen=False), LearnerConfig(pack_row_tokens=rows), dtype, 0, "cpu")
        assert (layout.mask_dtype, layout.row_tokens) == (mask_dtype, rows)


# --------------------------------------------------------------------------- transformers without a mask, on CPU


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return {
        impl: AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=impl).eval()
        for impl in ("sdpa", "eager")
    }


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_position_id_packing_gives_the_dense_masks_logprobs(models, impl):
    # the same packed row, once with our block mask and once with attention_mask=None and restarting
    # position ids (transformers finds the sequences itself): the same log-probs
    seqs = _random_seqs(SHAPES)
    dense_dtype = torch.bool if impl == "sdpa" else torch.float32
    (dense, view), (bare, _) = packed(seqs, PAD, mask_dtype=dense_dtype), packed(seqs, PAD, mask_dtype=None)
    assert dense.attention_mask is not None and bare.attention_mask is None
    with torch.no_grad():
        a = packed_completion_logprobs(models[impl](**dense.model_inputs()).logits, dense, view.completion_mask)
        b = packed_completion_logprobs(models[impl](**bare.model_inputs()).logits, bare, view.completion_mask)
    assert (a - b).abs().max().item() < PACKED_LOGPROB_ATOL
    assert a.abs().sum().item() > 1.0  # real log-probs, not zeroed slots


def test_sdpa_position_id_packing_is_a_dense_mask_in_transformers(models):
    # Not varlen: from position ids alone transformers 5.19 builds the same [1, 1, L, L] boolean
    # block mask as block_causal_mask, so for sdpa we keep building it ourselves.
    from transformers.masking_utils import create_causal_mask

    model = models["sdpa"]
    seqs = _random_seqs(SHAPES)
    bare, _ = packed(seqs, PAD, mask_dtype=None)
    embeds = model.get_input_embeddings()(bare.input_ids)
    built = create_causal_mask(model.config, embeds, None, None, position_ids=bare.position_ids)
    assert (
        built is not None
        and built.dtype == torch.bool
        and built.shape == (1, 1, sum(bare.seq_lens), sum(bare.seq_lens))
    )
    assert torch.equal(built, block_causal_mask([bare.seq_lens], torch.bool))
    # one sequence: no mask at all (sdpa's is_causal), which is why packing drops it then
    one = torch.arange(50)[None]
    assert create_causal_mask(model.config, embeds[:, :50], None, None, position_ids=one) is None


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_micro_batch_of_one_sequence_goes_without_a_mask(models, impl):
    seqs = _random_seqs([(20, 190)])
    batch, view = packed(seqs, PAD, mask_dtype=torch.bool if impl == "sdpa" else torch.float32)
    assert batch.attention_mask is None
    with torch.no_grad():
        reference = _unpadded_logprobs(models[impl], seqs)[0]
        logprobs = packed_completion_logprobs(models[impl](**batch.model_inputs()).logits, batch, view.completion_mask)
    assert (logprobs[0] - reference).abs().max().item() < PACKED_LOGPROB_ATOL


def test_the_critic_takes_the_chosen_kernel(tiny_model_dir):
    from learner.critic import build_value_model

    for impl in ("eager", "sdpa"):
        critic = build_value_model(tiny_model_dir, "policy", 0, attn_implementation=impl)
        assert critic.backbone.config._attn_implementation == impl
