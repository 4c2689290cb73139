#!/usr/bin/python3
"""Pure-Python model of what Megatron-core writes in a legacy (``--ckpt-format torch``) checkpoint, for the
two versions the tools emulate: v0.13.0 (default, the version ucp targets) and v0.8.0.

Shared by ``make_megatron_ckpts.py`` (the generator), ``compare_megatron_ckpt.py`` and
``check_universal.py``.  Nothing here imports torch: it is naming, placement and buffer-layout math.
Every rule below was re-expressed from the Megatron-LM sources at git tags ``core_v0.13.0`` and
``core_v0.8.0`` (and, for the Transformer Engine layer internals, TransformerEngine: ``v1.9`` for v0.8, the
``v2.5`` pre-release commit 8382eed that core_v0.13.0's docker/Dockerfile.ci.dev builds for v0.13); the
comment on each rule names the source as ``file:function``.  Paths are relative to the Megatron-LM
repository unless they start with ``TE:`` (TransformerEngine repository).  Where the versions differ the
rule is a function of ``cfg.megatron_version`` ("0.13" or "0.8"); version facts without a version tag
hold for both (checked in both trees).

Model: ``GPTModel`` built from ``get_gpt_layer_with_transformer_engine_spec()`` (the default with
``--transformer-impl transformer_engine`` in both versions), bf16 training (``Float16Module``), TE
FusedAdam.

Vocabulary used by the tools
  canonical name   state-dict name with the GLOBAL layer index (``decoder.layers.5.mlp.linear_fc1.weight``)
  local key        the key inside ``model`` / ``model{v}`` of one rank file (layer index local to the chunk)
  full tensor      the unsharded tensor at the TRUE vocabulary size; SwiGLU fc1 is ``[W_full; V_full]``
  padding block    ``pad_rows(cfg)`` deterministic extra rows for vocab-padded params; a topology whose
                   padded vocabulary is P uses the first ``P - vocab_size`` rows of the block

Per-version differences (what a reader/writer of both must handle; details at each rule):
  top-level keys   v0.13 adds 'rerun_state_machine' between 'opt_param_scheduler' and 'rng_state'
                   (checkpointing.py:generate_state_dict); order otherwise equal
  args             v0.13: 505 parse_args/validate_args fields (V013_ARGS_BASE) + the same 8 training
                   additions; v0.8: 330 (V08_ARGS_BASE).  v0.13 pickles an enum in args
                   (attention_backend = megatron.core.transformer.enums.AttnBackend.auto)
  TE _extra_state  v0.13 (TE 2.5): empty torch.uint8 tensor for every TE module; plus
                   'decoder.final_layernorm._extra_state' = uint8 tensor of pickle.dumps({}) (TE >= 1.13
                   norms are fusible ops with extra state).  v0.8 (TE 1.9): io.BytesIO of torch.save(None),
                   no extra state on the final norm
  buffer layout    v0.13 starts a shared-embedding param that opens its own bucket at the lcm(dp,128)-padded
                   bucket start; v0.8 keeps its 64-aligned start (straddle bug, MegatronVersionError)
  flops            different num_floating_point_operations formula (halved attention-score term, other
                   evaluation order) -> different num_floating_point_operations_so_far
  VPP              same rules (overlap_p2p_comm default True in both); the interleaved-schedule microbatch
                   check differs (topology_problem)
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

# ----------------------------------------------------------------------------------------------------
# Model configurations


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture knobs that change names, shapes or placement."""

    name: str
    num_layers: int = 8
    hidden_size: int = 8
    num_attention_heads: int = 8
    num_query_groups: int = 4            # == num_attention_heads when not group_query_attention
    group_query_attention: bool = True
    kv_channels: int = 2                 # explicit --kv-channels: heads * kv = 16 != hidden (legal)
    ffn_hidden_size: int = 16
    vocab_size: int = 130                # TRUE vocabulary (tokenizer.vocab_size); NullTokenizer --vocab-size V-1
    make_vocab_size_divisible_by: int = 32
    seq_length: int = 16
    max_position_embeddings: int = 16
    swiglu: bool = True
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = True
    normalization: str = "RMSNorm"       # "LayerNorm" | "RMSNorm"
    position_embedding_type: str = "rope"  # "rope" | "learned_absolute"
    # training hyper-parameters (identical for every topology of a variant).  micro batch 1 keeps every
    # topology of the grid runnable: the interleaved schedule needs num_microbatches = 16 / (1 * DP)
    # divisible by PP and >= PP (see topology_problem).
    micro_batch_size: int = 1
    global_batch_size: int = 16
    train_iters: int = 1000
    lr: float = 3e-4
    min_lr: float = 3e-5
    lr_warmup_iters: int = 10
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    seed: int = 1234
    iteration: int = 100
    # Megatron-core version whose files are emulated: "0.13" (default) or "0.8" (see VERSIONS)
    megatron_version: str = "0.13"
    # --overlap-grad-reduce --ddp-bucket-size N (None: neither, one bucket per buffer).  Only via
    # make_megatron_ckpts.py --ddp-bucket-size; the variants of the corpus leave it None.
    ddp_bucket_size: Optional[int] = None

    @property
    def tied(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def v013(self) -> bool:
        return self.megatron_version == "0.13"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


#: Emulated Megatron-core versions (git tags core_v0.13.0, core_v0.8.0).
VERSIONS = ("0.13", "0.8")
DEFAULT_VERSION = "0.13"


def with_version(cfg: "ModelConfig", version: str) -> "ModelConfig":
    if version not in VERSIONS:
        raise ValueError(f"unknown Megatron version {version!r} (known: {', '.join(VERSIONS)})")
    return dataclasses.replace(cfg, megatron_version=version)


#: The variants of the test corpus.  Dimensions: see the module docstring of make_megatron_ckpts.py.
VARIANTS: Dict[str, ModelConfig] = {
    # Llama-like: GQA, SwiGLU, biases on, untied head, RoPE (no position embedding), RMSNorm.
    "gqa_swiglu_bias_untied": ModelConfig(
        name="gqa_swiglu_bias_untied", num_query_groups=4, group_query_attention=True, swiglu=True,
        add_bias_linear=True, untie_embeddings_and_output_weights=True, normalization="RMSNorm",
        position_embedding_type="rope"),
    # GQA, SwiGLU, biases on, TIED embeddings, learned absolute position embedding, LayerNorm.
    "gqa_swiglu_bias_tied": ModelConfig(
        name="gqa_swiglu_bias_tied", num_query_groups=4, group_query_attention=True, swiglu=True,
        add_bias_linear=True, untie_embeddings_and_output_weights=False, normalization="LayerNorm",
        position_embedding_type="learned_absolute"),
    # GPT-2-like MHA, GeLU, --disable-bias-linear, tied, RoPE, LayerNorm (norm biases remain).
    "mha_gelu_nobias_tied": ModelConfig(
        name="mha_gelu_nobias_tied", num_query_groups=8, group_query_attention=False, swiglu=False,
        add_bias_linear=False, untie_embeddings_and_output_weights=False, normalization="LayerNorm",
        position_embedding_type="rope"),
}


def scaled_config(base: ModelConfig, overrides: Dict[str, int], name: Optional[str] = None) -> ModelConfig:
    """`base` with explicit sizes (keys: hidden, ffn, layers, vocab, heads, groups, kv, seq) replaced."""
    keymap = {"hidden": "hidden_size", "ffn": "ffn_hidden_size", "layers": "num_layers",
              "vocab": "vocab_size", "heads": "num_attention_heads", "groups": "num_query_groups",
              "kv": "kv_channels", "seq": "seq_length"}
    kw = {}
    for k, v in overrides.items():
        if k not in keymap:
            raise ValueError(f"unknown scale key {k!r} (known: {sorted(keymap)})")
        kw[keymap[k]] = int(v)
    if "seq_length" in kw:
        kw["max_position_embeddings"] = kw["seq_length"]
    if not base.group_query_attention:
        kw["num_query_groups"] = kw.get("num_attention_heads", base.num_attention_heads)
    return dataclasses.replace(base, name=name or base.name, **kw)


def padded_vocab_size(cfg: ModelConfig, tp: int) -> int:
    """megatron/training/tokenizer/tokenizer.py:_vocab_size_with_padding — round the tokenizer vocabulary up
    to a multiple of make_vocab_size_divisible_by * TP (so it changes with TP)."""
    multiple = cfg.make_vocab_size_divisible_by * tp
    return int(math.ceil(cfg.vocab_size / multiple) * multiple)


def pad_rows(cfg: ModelConfig) -> int:
    """Rows of the deterministic padding block: enough for every TP in (1, 2, 4, 8)."""
    return max(padded_vocab_size(cfg, tp) for tp in (1, 2, 4, 8)) - cfg.vocab_size


# ----------------------------------------------------------------------------------------------------
# Topologies


@dataclasses.dataclass(frozen=True, order=True)
class Topology:
    tp: int
    pp: int
    vpp: int      # 1 = no virtual pipeline (args.virtual_pipeline_model_parallel_size is None)
    dp: int
    distopt: bool

    @property
    def name(self) -> str:
        return f"tp{self.tp}_pp{self.pp}_vpp{self.vpp}_dp{self.dp}_{'do' if self.distopt else 'nodo'}"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank_dirs(self) -> List[Tuple[int, int, str]]:
        """(tp_rank, pp_rank, dir name) of every rank folder, in the order tools list them."""
        out = []
        for p in range(self.pp):
            for t in range(self.tp):
                out.append((t, p, rank_dir_name(t, p, self.pp)))
        return out


_TOPO_RE = re.compile(r"^tp(\d+)_pp(\d+)_vpp(\d+)_dp(\d+)_(do|nodo)$")


def parse_topology(text: str) -> Topology:
    m = _TOPO_RE.match(text.strip())
    if not m:
        raise ValueError(f"bad topology {text!r} (expected e.g. tp2_pp2_vpp1_dp2_do)")
    return Topology(int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5] == "do")


def overlap_p2p_comm(cfg: ModelConfig, t: Topology) -> bool:
    """args.overlap_p2p_comm of a run (megatron/training/arguments.py): '--no-overlap-p2p-communication'
    (store_false, so default True) in both v0.8 and v0.13; validate_args forces it (v0.13: and
    align_param_gather) to False without a virtual pipeline, and with it the interleaved schedule needs
    PP > 1 (PP > 2 only when it is switched off)."""
    return t.vpp > 1


def num_microbatches(cfg: ModelConfig, t: Topology) -> int:
    """megatron/core/num_microbatches_calculator.py (constant): global batch / (micro batch * DP)."""
    return cfg.global_batch_size // (cfg.micro_batch_size * t.dp)


def topology_problem(cfg: ModelConfig, t: Topology) -> Optional[str]:
    """Why Megatron (cfg.megatron_version) cannot train `cfg` at `t` up to a checkpoint (None if it can).
    The distributed-optimizer bucket check of v0.8 is separate (buffer_layout raises)."""
    if t.vpp > 1 and t.pp < 2:
        # training.py:get_model builds VPP chunks only when PP > 1 (and validate_args requires PP > 1
        # with overlap_p2p_comm, PP > 2 without, in both versions).
        return "virtual pipeline needs PP > 1"
    if cfg.num_layers % (t.pp * t.vpp):
        # arguments.py:validate_args: num_layers % PP == 0 and (L / PP) % layers-per-virtual-stage == 0
        return "num_layers not divisible by PP*VPP"
    if cfg.num_attention_heads % t.tp or cfg.num_query_groups % t.tp:
        return "heads / query groups not divisible by TP"  # attention.py:Attention.__init__ divide()
    if cfg.ffn_hidden_size % t.tp:
        return "ffn not divisible by TP"                    # TE layernorm_linear / linear split checks
    if cfg.global_batch_size % (cfg.micro_batch_size * t.dp):
        return "global batch not divisible by micro batch * DP"
    if t.vpp > 1:
        m = num_microbatches(cfg, t)
        if cfg.v013:
            # v0.13 pipeline_parallel/schedules.py:forward_backward_pipelining_with_interleaving with
            # microbatch_group_size_per_vp_stage = PP (model_parallel_config.py default): raises unless
            # PP <= M and (M % PP == 0 or M % PP >= PP).
            if m < t.pp or m % t.pp:
                return f"interleaved schedule: {m} microbatches, need a multiple of PP >= PP"
        elif m % t.pp:
            # v0.8 schedules.py:forward_backward_pipelining_with_interleaving raises unless M % PP == 0
            return f"interleaved schedule: {m} microbatches not divisible by PP"
    return None


#: The topology grids.
#: "full": TP {1,2,4} x PP {1,2,4} x VPP {1,2} (VPP only with PP > 1) x distributed optimizer on/off x DP, with
#:   DP {1,2,4} for the distributed optimizer and DP {1,2} without it: 75 per variant, all runnable by v0.13.
#:   Without the distributed optimizer DP changes no tensor of a rank file (the model, the optimizer state and
#:   its param groups are per (TP, PP) rank); it reaches the files only through args fields
#:   (data_parallel_size, world_size, rank of pp_rank > 0, local_rank, v0.13 inprocess_active_world_size;
#:   see args_items), which DP 2 already exercises (DP > 1, ranks >= 8 wrapping local_rank at TP 4) and the
#:   DP 4 distributed-optimizer folders exercise at DP 4.  With the distributed optimizer DP changes the
#:   buffer padding, the bucket sharding and which param groups carry 'step', so all three DPs stay.
#: "quick": 12 representative topologies per variant, a subset of "full": TP 4, PP 4, VPP with PP 2 and
#:   PP 4, tied PP > 1 with the distributed optimizer at DP 1/2/4, non-distributed DP 2.
GRIDS = ("full", "quick")
QUICK_TOPOLOGIES = (
    "tp1_pp1_vpp1_dp1_nodo", "tp2_pp1_vpp1_dp2_do", "tp4_pp1_vpp1_dp1_nodo", "tp1_pp2_vpp1_dp4_do",
    "tp2_pp2_vpp1_dp2_do", "tp2_pp2_vpp1_dp1_nodo", "tp1_pp2_vpp2_dp2_do", "tp2_pp2_vpp2_dp1_nodo",
    "tp1_pp4_vpp1_dp2_nodo", "tp2_pp4_vpp2_dp4_do", "tp4_pp2_vpp1_dp4_do", "tp4_pp4_vpp2_dp1_do",
)


def grid_candidates(grid: str = "full") -> List[Topology]:
    """The topologies a grid asks for (VPP only with PP > 1), before asking whether Megatron can run them."""
    if grid == "quick":
        return [parse_topology(x) for x in QUICK_TOPOLOGIES]
    if grid == "full":
        return [Topology(tp, pp, vpp, dp, do) for tp in (1, 2, 4) for pp in (1, 2, 4) for vpp in (1, 2)
                for dp in (1, 2, 4) for do in (False, True) if (vpp == 1 or pp > 1) and (do or dp < 4)]
    raise ValueError(f"unknown grid {grid!r} (known: {', '.join(GRIDS)})")


def all_topologies(cfg: ModelConfig, grid: str = "full") -> List[Topology]:
    """grid_candidates that pass topology_problem (v0.8's bucket check is separate: buffer_layout)."""
    return [t for t in grid_candidates(grid) if topology_problem(cfg, t) is None]


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """megatron/training/checkpointing.py:get_checkpoint_name — mp_rank_TT without PP, mp_rank_TT_PPP with PP>1
    (EP == 1 here, so no expert suffix)."""
    if pp == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def iter_dir_name(iteration: int) -> str:
    """checkpointing.py:get_checkpoint_name — 'iter_{:07d}' (or 'release')."""
    return f"iter_{iteration:07d}"


TRACKER_NAME = "latest_checkpointed_iteration.txt"  # checkpointing.py:get_checkpoint_tracker_filename


def global_rank(t: Topology, tp_rank: int, pp_rank: int, dp_rank: int = 0) -> int:
    """megatron/core/parallel_state.py:RankGenerator with order 'tp-cp-ep-dp-pp' (initialize.py default):
    TP fastest, then CP(=1), EP(=1), DP, PP slowest."""
    return tp_rank + t.tp * dp_rank + t.tp * t.dp * pp_rank


# ----------------------------------------------------------------------------------------------------
# Pipeline placement


def chunk_layers(cfg: ModelConfig, t: Topology, pp_rank: int, vp: int) -> List[int]:
    """Global layer indices held by chunk `vp` of PP rank `pp_rank`.

    megatron/core/transformer/transformer_block.py:get_num_layers_to_build (L/PP, divided by VP) and
    transformer_layer.py:TransformerLayer._get_layer_offset (v0.8) / get_transformer_layer_offset (v0.13,
    even split without layout, uneven first/last stage or embedding/loss accounting):
      VPP:  offset = vp * (L // VP) + pp_rank * (L // PP // VP)
      else: offset = pp_rank * (L // PP)
    pre_process / post_process per chunk (training.py:get_model): is_pipeline_first_stage(vp_stage=vp) /
    is_pipeline_last_stage(vp_stage=vp), same in both versions.
    """
    n = cfg.num_layers // t.pp // t.vpp
    if t.vpp > 1:
        off = vp * (cfg.num_layers // t.vpp) + pp_rank * n
    else:
        off = pp_rank * n
    return list(range(off, off + n))


def is_first_stage(t: Topology, pp_rank: int, vp: int) -> bool:
    """parallel_state.py:is_pipeline_first_stage — PP rank 0 and (no VPP or virtual rank 0)."""
    return pp_rank == 0 and vp == 0


def is_last_stage(t: Topology, pp_rank: int, vp: int) -> bool:
    """parallel_state.py:is_pipeline_last_stage — last PP rank and (no VPP or last virtual rank)."""
    return pp_rank == t.pp - 1 and vp == t.vpp - 1


# ----------------------------------------------------------------------------------------------------
# Parameters and state-dict entries


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """A canonical (full) parameter."""

    name: str                  # canonical name
    shape: Tuple[int, ...]     # full shape at the TRUE vocab size
    split: str                 # "replicated" | "dim0" | "dim1"
    vocab: bool = False        # dim 0 is the (padded) vocabulary
    glu: bool = False          # SwiGLU fc1 weight/bias: full [W; V], rank-local [W_r; V_r]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def weight_decay(self) -> bool:
        """megatron/core/optimizer/__init__.py:_get_param_groups — no weight decay for names ending in
        '.bias' or 1-D params (TE's 'layer_norm_bias' also is 1-D)."""
        return not (self.name.endswith(".bias") or len(self.shape) == 1)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry of a chunk's model state dict, in state-dict order."""

    key: str                   # local key
    kind: str                  # "param" | "extra_te" (TE module _extra_state, te_extra_state()) |
    #                            "extra_te_op" (TE fusible-op norm _extra_state, v0.13 only) | "extra_none"
    param: Optional[ParamSpec] = None   # for kind == "param": the canonical param it holds
    tied_copy: bool = False     # last-stage output_layer.weight copy of the word embedding
    shared_embedding: bool = False      # param.shared_embedding (own DistOpt bucket)


def te_extra_state_kind(cfg: ModelConfig) -> str:
    """How a TE module's '_extra_state' is encoded without FP8 (the generator builds the object):

    "bytesio_torch_save_none"  v0.8 / TE 1.9: TE:module/base.py:TransformerEngineBaseModule.get_extra_state
                               returns io.BytesIO holding torch.save(None) (position left at the end).
    "empty_uint8"              v0.13 / TE 2.5: the same method returns torch.empty(0, dtype=torch.uint8) when
                               the module has no FP8 state (TE PR #1799, first in TE 2.4; TE 2.0-2.3 returned
                               a uint8 tensor of pickle.dumps(None)).  core_v0.13.0 was tested against TE 2.5
                               (docker/Dockerfile.ci.dev TE_COMMIT 8382eed = v2.5~1; extensions/
                               transformer_engine.py gates features on is_te_min_version("2.5.0")).
    The v0.13 final norm ("extra_te_op" entries) is a TE fusible op: TE:ops/op.py:
    BasicOperation.get_extra_state pickles {} (no quantizer state for either mode, num_quantizers() == 0)
    into a uint8 tensor: te_op_extra_state_bytes()."""
    return "empty_uint8" if cfg.v013 else "bytesio_torch_save_none"


def te_op_extra_state_bytes() -> bytes:
    """Bytes of the uint8 tensor TE 2.5 BasicOperation.get_extra_state returns without FP8:
    bytearray(pickle.dumps({})) with Python's default protocol (4 on Python 3.8-3.13; NGC 25.x ships 3.12)."""
    import pickle
    return pickle.dumps({}, protocol=4)


def _layer_params(cfg: ModelConfig, g: int) -> List[Tuple[str, Optional[ParamSpec]]]:
    """State-dict entries of global layer g with a layer-relative key, in state-dict order (None = TE
    _extra_state).

    Order = module registration order (torch.nn.Module.state_dict: own params, then _extra_state, then
    children).  transformer_layer.py:TransformerLayer.__init__: input_layernorm (IdentityOp with the TE
    spec), self_attention, pre_cross_attn_layernorm, cross_attention, cross_attn_bda (IdentityOp /
    IdentityFuncOp), pre_mlp_layernorm (IdentityOp), mlp.  attention.py:Attention.__init__ builds
    core_attention and linear_proj BEFORE SelfAttention.__init__ builds linear_qkv (and q/k_layernorm), so
    linear_proj precedes linear_qkv.  mlp.py:MLP.__init__: linear_fc1 then linear_fc2.
    TE modules (TE:transformer_engine/pytorch/module/layernorm_linear.py:LayerNormLinear.__init__):
    layer_norm_weight, layer_norm_bias (not for RMSNorm), weight, bias (only with bias; otherwise a plain
    tensor attribute, not in the state dict); TE:module/base.py:TransformerEngineBaseModule.get_extra_state
    adds '_extra_state' (encoding: te_extra_state_kind).  TEDotProductAttention (TE:attention.py /
    TE 2.x attention/dot_product_attention/dot_product_attention.py:DotProductAttention, a
    TransformerEngineBaseModule since TE 1.8; TE <= 1.7 had the extra state one level down,
    'core_attention.fused_attention._extra_state') has no params but an _extra_state.  Targets: TE 1.8/1.9
    (NGC 24.07/24.08, the containers of Megatron-core 0.8); TE 2.5 for v0.13 (same registration order,
    checked in TE v2.5 layernorm_linear.py / linear.py).  The layer structure is unchanged in core_v0.13.0
    (transformer_layer.py, attention.py, mlp.py, gpt_layer_specs.py:get_gpt_layer_with_transformer_engine_spec
    with TESpecProvider: linear_qkv/linear_fc1 = TELayerNormColumnParallelLinear, linear_proj/linear_fc2 =
    TERowParallelLinear, core_attention = TEDotProductAttention, input/pre_mlp layernorm IdentityOp).
    """
    h, nq, ng, d, f = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels,
                       cfg.ffn_hidden_size)
    p = f"decoder.layers.{g}."
    qkv_rows = (nq + 2 * ng) * d            # attention.py:SelfAttention: query_projection + 2*kv_projection
    fc1_rows = f * 2 if cfg.swiglu else f   # mlp.py:MLP.__init__: gated_linear_unit doubles fc1
    out: List[Tuple[str, Optional[ParamSpec]]] = []
    out.append(("self_attention.core_attention._extra_state", None))
    # linear_proj = TERowParallelLinear(query_projection_size -> hidden): weight [h, nq*d] split on dim 1,
    # bias [h] replicated (TE row-parallel bias is full size).
    out.append(("self_attention.linear_proj.weight", ParamSpec(p + "self_attention.linear_proj.weight",
                                                               (h, nq * d), "dim1")))
    if cfg.add_bias_linear:
        out.append(("self_attention.linear_proj.bias", ParamSpec(p + "self_attention.linear_proj.bias",
                                                                 (h,), "replicated")))
    out.append(("self_attention.linear_proj._extra_state", None))
    # linear_qkv = TELayerNormColumnParallelLinear: rows grouped per query group [ng, nq/ng + 2, d]
    # (attention.py:SelfAttention.get_query_key_value_tensors), split on dim 0.
    q = "self_attention.linear_qkv."
    out.append((q + "layer_norm_weight", ParamSpec(p + q + "layer_norm_weight", (h,), "replicated")))
    if cfg.normalization == "LayerNorm":
        out.append((q + "layer_norm_bias", ParamSpec(p + q + "layer_norm_bias", (h,), "replicated")))
    out.append((q + "weight", ParamSpec(p + q + "weight", (qkv_rows, h), "dim0")))
    if cfg.add_bias_linear:   # bias = add_bias_linear or add_qkv_bias (False)
        out.append((q + "bias", ParamSpec(p + q + "bias", (qkv_rows,), "dim0")))
    out.append((q + "_extra_state", None))
    m = "mlp.linear_fc1."
    out.append((m + "layer_norm_weight", ParamSpec(p + m + "layer_norm_weight", (h,), "replicated")))
    if cfg.normalization == "LayerNorm":
        out.append((m + "layer_norm_bias", ParamSpec(p + m + "layer_norm_bias", (h,), "replicated")))
    out.append((m + "weight", ParamSpec(p + m + "weight", (fc1_rows, h), "dim0", glu=cfg.swiglu)))
    if cfg.add_bias_linear:
        out.append((m + "bias", ParamSpec(p + m + "bias", (fc1_rows,), "dim0", glu=cfg.swiglu)))
    out.append((m + "_extra_state", None))
    m = "mlp.linear_fc2."
    out.append((m + "weight", ParamSpec(p + m + "weight", (h, f), "dim1")))
    if cfg.add_bias_linear:
        out.append((m + "bias", ParamSpec(p + m + "bias", (h,), "replicated")))
    out.append((m + "_extra_state", None))
    return out


def embedding_spec(cfg: ModelConfig) -> ParamSpec:
    # tensor_parallel/layers.py:VocabParallelEmbedding: [padded_vocab / TP, h], contiguous vocab ranges.
    return ParamSpec("embedding.word_embeddings.weight", (cfg.vocab_size, cfg.hidden_size), "dim0", vocab=True)


def output_spec(cfg: ModelConfig) -> ParamSpec:
    # gpt_model.py:GPTModel.__init__: ColumnParallelLinear(h -> vocab, bias=False), weight [V/TP, h].
    return ParamSpec("output_layer.weight", (cfg.vocab_size, cfg.hidden_size), "dim0", vocab=True)


def chunk_entries(cfg: ModelConfig, t: Topology, pp_rank: int, vp: int) -> List[Entry]:
    """The model state dict of one chunk, in order (gpt_model.py:GPTModel.__init__ registration order:
    embedding [pre_process], rotary_pos_emb [no state], decoder, output_layer [post_process])."""
    pre = is_first_stage(t, pp_rank, vp)
    post = is_last_stage(t, pp_rank, vp)
    out: List[Entry] = []
    # language_module.py:LanguageModule.setup_embeddings_and_output_layer: with tied embeddings and
    # pre_process != post_process the embedding (first stage) and the output_layer copy (last stage) get
    # `shared_embedding = True`; with pre and post on one chunk the head reuses the embedding weight.
    shared = cfg.tied and (pre != post)
    if pre:
        out.append(Entry("embedding.word_embeddings.weight", "param", embedding_spec(cfg),
                         shared_embedding=shared))
        if cfg.position_embedding_type == "learned_absolute":
            # language_model_embedding.py: torch.nn.Embedding(max_sequence_length, h), replicated.
            out.append(Entry("embedding.position_embeddings.weight", "param",
                             ParamSpec("embedding.position_embeddings.weight",
                                       (cfg.max_position_embeddings, cfg.hidden_size), "replicated")))
    for local, g in enumerate(chunk_layers(cfg, t, pp_rank, vp)):
        for rel, spec in _layer_params(cfg, g):
            key = f"decoder.layers.{local}.{rel}"
            out.append(Entry(key, "param", spec) if spec is not None else Entry(key, "extra_te"))
    if post:
        # transformer_block.py:TransformerBlock._build_layers: final_layernorm = TENorm
        # (extensions/transformer_engine.py:TENorm.__new__ -> te.pytorch.LayerNorm: weight, bias /
        # te.pytorch.RMSNorm: weight).  TE 1.9 (v0.8): plain torch modules without _extra_state.
        # TE >= 1.13 (v0.13 / TE 2.5): subclasses of the fusible ops TE:ops/basic/layer_norm.py:LayerNorm /
        # rmsnorm.py:RMSNorm, whose TE:ops/op.py:BasicOperation.get_extra_state adds '_extra_state'.
        out.append(Entry("decoder.final_layernorm.weight", "param",
                         ParamSpec("decoder.final_layernorm.weight", (cfg.hidden_size,), "replicated")))
        if cfg.normalization == "LayerNorm":
            out.append(Entry("decoder.final_layernorm.bias", "param",
                             ParamSpec("decoder.final_layernorm.bias", (cfg.hidden_size,), "replicated")))
        if cfg.v013:
            out.append(Entry("decoder.final_layernorm._extra_state", "extra_te_op"))
        if cfg.untie_embeddings_and_output_weights:
            out.append(Entry("output_layer.weight", "param", output_spec(cfg)))
        elif not pre:
            # skip_weight_param_allocation only when pre_process and shared: the last stage allocates its
            # own copy (zero-filled, then all-reduced with the first stage at init; identical thereafter).
            out.append(Entry("output_layer.weight", "param", embedding_spec(cfg), tied_copy=True,
                             shared_embedding=True))
        # tensor_parallel/layers.py:ColumnParallelLinear.get_extra_state returns None (state key kept).
        out.append(Entry("output_layer._extra_state", "extra_none"))
    return out


def chunk_params(cfg: ModelConfig, t: Topology, pp_rank: int, vp: int) -> List[Entry]:
    """named_parameters() order of a chunk == the param entries of its state dict."""
    return [e for e in chunk_entries(cfg, t, pp_rank, vp) if e.kind == "param"]


def canonical_params(cfg: ModelConfig) -> List[ParamSpec]:
    """Canonical order: the params of the unsharded (TP=PP=1) model in named_parameters() order."""
    t = Topology(1, 1, 1, 1, False)
    return [e.param for e in chunk_params(cfg, t, 0, 0)]


def module_paths(cfg: ModelConfig, t: Topology, pp_rank: int, vp: int) -> List[str]:
    """Pre-order module prefixes of a chunk (the keys of the state dict's ``_metadata``; best effort for
    the TE-internal submodules, from TE v1.9 DotProductAttention.__init__)."""
    pre = is_first_stage(t, pp_rank, vp)
    post = is_last_stage(t, pp_rank, vp)
    out = [""]
    if pre:
        out += ["embedding", "embedding.word_embeddings"]
        if cfg.position_embedding_type == "learned_absolute":
            out.append("embedding.position_embeddings")
        out.append("embedding.embedding_dropout")
    if cfg.position_embedding_type == "rope":
        out.append("rotary_pos_emb")
    out += ["decoder", "decoder.layers"]
    for local in range(len(chunk_layers(cfg, t, pp_rank, vp))):
        p = f"decoder.layers.{local}"
        ca = p + ".self_attention.core_attention"
        out += [p, p + ".input_layernorm", p + ".self_attention", ca, ca + ".flash_attention",
                ca + ".fused_attention", ca + ".unfused_attention",
                ca + ".unfused_attention.scale_mask_softmax", ca + ".unfused_attention.attention_dropout",
                p + ".self_attention.linear_proj", p + ".self_attention.linear_qkv",
                p + ".self_attention.q_layernorm", p + ".self_attention.k_layernorm",
                p + ".pre_cross_attn_layernorm", p + ".cross_attention", p + ".cross_attn_bda",
                p + ".pre_mlp_layernorm", p + ".mlp", p + ".mlp.linear_fc1", p + ".mlp.linear_fc2"]
    if post:
        out.append("decoder.final_layernorm")
        out.append("output_layer")
    return out


# ----------------------------------------------------------------------------------------------------
# Tensor-parallel sharding


@dataclasses.dataclass(frozen=True)
class Piece:
    """Local rows/cols [local_start, local_end) along `dim` come from the full tensor ("full") or the
    padding block ("pad") at [src_start, src_end) along the same dim."""

    dim: int
    local_start: int
    local_end: int
    src: str
    src_start: int
    src_end: int


def local_shape(spec: ParamSpec, cfg: ModelConfig, tp: int) -> Tuple[int, ...]:
    shape = list(spec.shape)
    if spec.vocab:
        shape[0] = padded_vocab_size(cfg, tp)
    if spec.split == "dim0":
        shape[0] //= tp
    elif spec.split == "dim1":
        shape[1] //= tp
    return tuple(shape)


def shard_pieces(spec: ParamSpec, cfg: ModelConfig, tp: int, rank: int) -> List[Piece]:
    """How TP rank `rank`'s local tensor is cut from the full tensor (and padding block).

    - replicated: the whole tensor.
    - dim0 / dim1: contiguous equal chunk (ColumnParallelLinear / TE column: dim 0; Row: dim 1;
      tensor_parallel/layers.py & TE Linear parallel_mode). Fused QKV is a plain dim-0 chunk because the
      full rows are already grouped per query group and ng % TP == 0.
    - vocab: dim 0 of the padded tensor [full rows; pad rows], chunked (VocabParallelEmbedding vocab ranges).
    - glu: local = [W_r; V_r], W_r = W[r*f/TP:(r+1)*f/TP], V_r likewise (TE column-parallel split of the
      doubled fc1; mlp.py apply_swiglu_sharded_factory documents the same interleave).
    """
    if spec.split == "replicated":
        return [Piece(0, 0, spec.shape[0], "full", 0, spec.shape[0])]
    if spec.split == "dim1":
        n = spec.shape[1] // tp
        return [Piece(1, 0, n, "full", rank * n, (rank + 1) * n)]
    if spec.glu:
        f = spec.shape[0] // 2
        n = f // tp
        return [Piece(0, 0, n, "full", rank * n, (rank + 1) * n),
                Piece(0, n, 2 * n, "full", f + rank * n, f + (rank + 1) * n)]
    if spec.vocab:
        total = padded_vocab_size(cfg, tp)
        n = total // tp
        lo, hi = rank * n, (rank + 1) * n
        out = []
        v = spec.shape[0]
        if lo < v:
            out.append(Piece(0, 0, min(hi, v) - lo, "full", lo, min(hi, v)))
        if hi > v:
            s = max(lo, v)
            out.append(Piece(0, s - lo, hi - lo, "pad", s - v, hi - v))
        return out
    n = spec.shape[0] // tp
    return [Piece(0, 0, n, "full", rank * n, (rank + 1) * n)]


# ----------------------------------------------------------------------------------------------------
# Optimizer parameter groups


GROUP_KEY_FIELDS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def group_key(spec: ParamSpec) -> Tuple[float, float, bool, bool]:
    """optimizer/__init__.py:_get_param_groups key (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)
    with no scale_lr_cond, no decoupled lr, no experts."""
    return (1.0 if spec.weight_decay else 0.0, 1.0, False, False)


def param_groups(cfg: ModelConfig, t: Topology, pp_rank: int) -> List[Tuple[Tuple, List[Tuple[int, Entry]]]]:
    """[(key, [(chunk, entry), ...]), ...]: groups in FIRST-APPEARANCE order of their key over
    named_parameters() of all chunks (chunk 0 first); members in that order (neither v0.8 nor v0.13 sorts
    groups: core_v0.13.0 optimizer/__init__.py:_get_param_groups iterates params_map in insertion order, the
    no-wd rule is still "name.endswith('.bias') or len(param.shape) == 1").  v0.13's get_megatron_optimizer
    always returns a ChainedOptimizer, whose state_dict()/save_parameter_state() pass a single optimizer's
    through unchanged (optimizer.py:ChainedOptimizer), so the files keep the single-optimizer layout."""
    groups: Dict[Tuple, List[Tuple[int, Entry]]] = {}
    for vp in range(t.vpp):
        for e in chunk_params(cfg, t, pp_rank, vp):
            groups.setdefault(group_key(e.param), []).append((vp, e))
    return list(groups.items())


def canonical_groups(cfg: ModelConfig) -> List[Tuple]:
    """Group keys in first-appearance order over the canonical params (the same on every rank here)."""
    keys: List[Tuple] = []
    for spec in canonical_params(cfg):
        k = group_key(spec)
        if k not in keys:
            keys.append(k)
    return keys


def scheduler_state(cfg: ModelConfig) -> dict:
    """OptimizerParamScheduler.state_dict (v0.8 training/optimizer_param_scheduler.py, v0.13
    core/optimizer_param_scheduler.py: same keys, order and arithmetic) after `iteration` steps of
    increment global_batch_size (training.py:get_optimizer_param_scheduler, iteration-based: warmup and
    decay steps are iters * global batch)."""
    gbs = cfg.global_batch_size
    return {
        "max_lr": float(cfg.lr),
        "lr_warmup_steps": cfg.lr_warmup_iters * gbs,
        "num_steps": cfg.iteration * gbs,
        "lr_decay_style": "cosine",
        "lr_decay_steps": cfg.train_iters * gbs,
        "min_lr": cfg.min_lr,
        "start_wd": cfg.weight_decay,
        "end_wd": cfg.weight_decay,
        "wd_incr_style": "constant",
        "wd_incr_steps": cfg.train_iters * gbs,
    }


def scheduled_lr(cfg: ModelConfig) -> float:
    """OptimizerParamScheduler.get_lr (cosine after linear warmup, init_lr 0) at num_steps."""
    s = scheduler_state(cfg)
    n, w, dsteps = s["num_steps"], s["lr_warmup_steps"], s["lr_decay_steps"]
    max_lr, min_lr = s["max_lr"], s["min_lr"]
    if w > 0 and n <= w:
        return 0.0 + ((max_lr - 0.0) * float(n) / float(w))
    if n > dsteps:
        return min_lr
    ratio = float(n - w) / float(dsteps - w)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


def group_hyperparams(cfg: ModelConfig, key: Tuple, with_step: bool) -> List[Tuple[str, object]]:
    """Non-'params' entries of one inner-optimizer param group, in dict order.

    _get_param_groups creates {'params', 'wd_mult', 'lr_mult', 'is_expert_parallel', 'is_decoupled_lr'};
    _update_min_and_max_lr_in_param_groups adds 'max_lr', 'min_lr'; torch Optimizer.add_param_group
    setdefaults TE FusedAdam's defaults in its order (TE:optimizers/fused_adam.py:FusedAdam.__init__: lr,
    bias_correction, betas, eps, weight_decay); FusedAdam.step adds 'step' (an int, per GROUP; never in the
    per-param state) on the first step of a non-empty group; OptimizerParamScheduler.step overwrites 'lr'
    (lr * lr_mult) and 'weight_decay' (wd * wd_mult) in place.  torch Optimizer.state_dict moves 'params'
    to the end.  Same in v0.13 with TE 2.5: TE:optimizers/fused_adam.py keeps the defaults dict order and the
    per-group int 'step' (not capturable), and its state_dict override returns the fp32 exp_avg/exp_avg_sq
    tensors unchanged (get_unscaled_state of float32 states); the DistributedOptimizer (v0.13
    distrib_optimizer.py:state_dict) still drops 'state' and every group's 'params'.
    """
    wd_mult, lr_mult, is_ep, is_dec = key
    items: List[Tuple[str, object]] = [
        ("wd_mult", wd_mult), ("lr_mult", lr_mult), ("is_expert_parallel", is_ep),
        ("is_decoupled_lr", is_dec), ("max_lr", cfg.lr), ("min_lr", cfg.min_lr),
        ("lr", scheduled_lr(cfg) * lr_mult), ("bias_correction", True),
        ("betas", (cfg.adam_beta1, cfg.adam_beta2)), ("eps", cfg.adam_eps),
        ("weight_decay", cfg.weight_decay * wd_mult)]
    if with_step:
        items.append(("step", cfg.iteration))
    return items


# ----------------------------------------------------------------------------------------------------
# DistributedOptimizer buffer layout


class MegatronVersionError(Exception):
    """The emulated Megatron version itself would fail on this configuration (e.g. at DistributedOptimizer
    init), so it cannot produce the checkpoint."""


MegatronV08Error = MegatronVersionError   # the v0.8 bucket quirk is the only source today


@dataclasses.dataclass
class BufferLayout:
    """ParamAndGradBuffer layout of one (model chunk, dtype) buffer.

    index[key] = (start, end, bucket_id) in buffer coordinates; buckets[b] = (start, end, numel_unpadded).
    """

    index: Dict[str, Tuple[int, int, int]]
    buckets: List[Tuple[int, int, int]]
    order: List[str]            # keys in buffer order (= reversed named_parameters)

    @property
    def numel(self) -> int:
        return self.buckets[-1][1] if self.buckets else 0

    @property
    def numel_unpadded(self) -> int:
        return sum(b[2] for b in self.buckets)

    def world_offset(self, key: str) -> int:
        """Offset of `key` in the distrib_optim.pt world tensors: buffer start minus the bucket-end padding
        of all earlier buckets (distrib_optimizer.py:get_parameter_state_dp_zero copies bucket b's first
        numel_unpadded elements at the running offset)."""
        start, _, b = self.index[key]
        return start - sum(e - s - u for (s, e, u) in self.buckets[:b])

    def dp_range(self, bucket: int, dp: int, dp_rank: int) -> Tuple[int, int]:
        """distrib_optimizer.py:_build_model_gbuf_range — DP rank r owns [off + r*n/dp, off + (r+1)*n/dp)."""
        s, e, _ = self.buckets[bucket]
        n = (e - s) // dp
        return s + dp_rank * n, s + (dp_rank + 1) * n


def buffer_layout(params: Sequence[Tuple[str, int, bool]], dp: int, distopt: bool,
                  bucket_size: Optional[int] = None, version: str = DEFAULT_VERSION) -> BufferLayout:
    """distributed/param_and_grad_buffer.py:_ParamAndGradBuffer.__init__ (v0.13; ParamAndGradBuffer in v0.8).

    `params` = (key, numel, shared_embedding) in named_parameters() order of the buffer's params
    (all bf16 params of one model chunk: one (bf16, fp32) buffer per chunk,
    distributed_data_parallel.py:DistributedDataParallel.__init__ groups params by (param dtype,
    grad dtype = fp32 with accumulate_allreduce_grads_in_fp32)).  Rules, iterating params[::-1]:
      - with the distributed optimizer each param start is padded to a multiple of 64
        (_pad_start_of_param_if_needed) and every bucket end to lcm(dp, 128) (_pad_end_of_bucket_if_needed;
        v0.13 pads to lcm(dp, 128, 2**16) only with --ddp-pad-buckets-for-high-nccl-busbw, default off);
        without it nothing is padded.
      - a shared_embedding param (only with the distributed optimizer, _does_param_require_new_bucket)
        first closes the current non-empty bucket at its (64-aligned) start, then closes its own bucket
        right after itself.
      - bucket_size (None unless --overlap-grad-reduce) closes a bucket once it holds >= bucket_size.
      - numel_unpadded of a bucket = its end before end padding minus its start (so it includes the
        64-alignment gap before a shared param that closes it).
    Where the shared param starts after closing the previous bucket:
      v0.13  at the padded end of the closed bucket ("param_start_index = _update_bucket_metadata(
             param_start_index)"): always bucket-aligned, every topology works.
      v0.8   the padded end returned by _create_new_bucket is discarded, so the shared param keeps its
             64-aligned start even if the next bucket starts later.  If that start is not bucket-aligned
             the param straddles two buckets; v0.8's DistributedOptimizer then asserts ("each param only
             belongs to a single bucket", whenever one DP rank's ranges meet both parts, always for DP 1)
             or saves a distrib_optim.pt without the straddling part -- either way no valid checkpoint:
             raised here as MegatronVersionError.
    """
    if version not in VERSIONS:
        raise ValueError(f"unknown Megatron version {version!r}")

    def pad(x: int, m: int) -> int:
        return int(math.ceil(x / m) * m)

    def pad_end(x: int) -> int:
        return pad(x, math.lcm(dp, 128)) if distopt else x

    def pad_start(x: int) -> int:
        return pad(x, 64) if distopt else x

    index: Dict[str, Tuple[int, int, int]] = {}
    buckets: List[Tuple[int, int, int]] = []
    order: List[str] = []
    start = 0
    end = 0
    bucket_start = 0
    bucket_count = 0   # params in the current bucket

    def new_bucket(end_unpadded: int) -> int:
        nonlocal bucket_start, bucket_count
        padded = pad_end(end_unpadded)
        buckets.append((bucket_start, padded, end_unpadded - bucket_start))
        bucket_start = padded
        bucket_count = 0
        return padded

    for key, numel, shared in reversed(list(params)):
        start = pad_start(start)
        needs_own = shared and distopt
        if needs_own and bucket_count > 0:
            padded = new_bucket(start)
            if version == "0.13":
                start = padded
            elif start % dp != 0:
                raise MegatronVersionError(f"{key}: bucket start {start} not divisible by dp {dp}")
        end = start + numel
        index[key] = (start, end, len(buckets))
        order.append(key)
        bucket_count += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or needs_own:
            end = new_bucket(end)
        start = end
    if bucket_count > 0:
        new_bucket(end)
    layout = BufferLayout(index, buckets, order)
    for key, (s, e, b) in index.items():
        bs, be, _ = buckets[b]
        if not (bs <= s and e <= be):
            raise MegatronVersionError(
                f"{key} occupies [{s},{e}) outside its bucket {b} [{bs},{be}): it straddles two buckets, "
                "so Megatron core v0.8's DistributedOptimizer asserts ('each param only belongs to a single "
                "bucket') or, if no DP rank sees both parts, drops the part outside numel_unpadded")
    return layout


def chunk_buffer_layout(cfg: ModelConfig, t: Topology, pp_rank: int, vp: int,
                        bucket_size: Optional[int] = None) -> BufferLayout:
    """The (bf16, fp32) buffer of one chunk.  bucket_size defaults to cfg.ddp_bucket_size (with
    --overlap-grad-reduce, training.py:get_model passes --ddp-bucket-size to DistributedDataParallelConfig);
    DistributedDataParallel disables bucketing for chunks > 0 (training.py:get_model disable_bucketing) and
    for pp_rank > 0 (distributed_data_parallel.py:DistributedDataParallel.__init__)."""
    if bucket_size is None:
        bucket_size = cfg.ddp_bucket_size
    if vp > 0 or pp_rank > 0:
        bucket_size = None
    params = [(e.key, math.prod(local_shape(e.param, cfg, t.tp)), e.shared_embedding)
              for e in chunk_params(cfg, t, pp_rank, vp)]
    return buffer_layout(params, t.dp, t.distopt, bucket_size, cfg.megatron_version)


def groups_with_step_on_dp0(cfg: ModelConfig, t: Topology, pp_rank: int,
                            layouts: Sequence[BufferLayout]) -> List[bool]:
    """With the distributed optimizer the saved param_groups are DP rank 0's: a group whose rank-0 shard
    holds no element of any of its params is empty there, FusedAdam.step skips it ('if len(group["params"])
    == 0: continue', TE 1.9 and 2.5) and the group has no 'step' key (distrib_optimizer.py:
    _build_optimizer_group_ranges only lists params intersecting the rank's ranges but keeps empty groups;
    unchanged in core_v0.13.0)."""
    out = []
    for _key, members in param_groups(cfg, t, pp_rank):
        has = False
        for vp, e in members:
            lay = layouts[vp]
            s, en, _b = lay.index[e.key]
            # _build_model_gbuf_param_range_map intersects the param with every bucket's rank-0 range
            for bb in range(len(lay.buckets)):
                lo, hi = lay.dp_range(bb, t.dp, 0)
                if min(hi, en) > max(lo, s):
                    has = True
        out.append(has)
    return out


# ----------------------------------------------------------------------------------------------------
# RNG state (checkpointing.py:get_rng_state, initialize.py:_set_random_seed, tensor_parallel/random.py)


def rng_seeds(cfg: ModelConfig, t: Topology, tp_rank: int, pp_rank: int) -> Dict[str, int]:
    """Seeds of the generators whose state a rank saves.

    initialize.py:_set_random_seed: seed = args.seed + 100 * pp_rank (no data_parallel_random_init);
    random.seed / np.random.seed / torch.manual_seed(seed); model_parallel_cuda_manual_seed(seed):
    cuda default = seed, tracker 'data-parallel-rng' = seed, 'model-parallel-rng' = seed + 2718 + tp_rank,
    'expert-parallel-rng' = seed + 1024 + 100 * ep_rank + tp_rank (added in that order).
    Unchanged in core_v0.13.0 (initialize.py:_set_random_seed, tensor_parallel/random.py:
    model_parallel_cuda_manual_seed with etp_rank = tp_rank since expert_tensor_parallel_size defaults to TP;
    checkpointing.py:get_rng_state keys and the one-element list without --data-parallel-random-init)."""
    seed = cfg.seed + 100 * pp_rank
    return {"seed": seed, "data-parallel-rng": seed, "model-parallel-rng": seed + 2718 + tp_rank,
            "expert-parallel-rng": seed + 1024 + tp_rank}


RNG_TRACKER_NAMES = ("data-parallel-rng", "model-parallel-rng", "expert-parallel-rng")


# ----------------------------------------------------------------------------------------------------
# args Namespace


def num_floating_point_operations(cfg: ModelConfig, padded_vocab: int) -> float:
    """training.py:num_floating_point_operations(args, batch_size) for one iteration (batch_size = the
    global batch: train() passes DP * micro batch * num_microbatches).  Dense GPT, no MoE / MTP / MLA /
    hybrid.  The arithmetic is spelled in the source's evaluation order so the float bits match."""
    nq, h, s_len, L = cfg.num_attention_heads, cfg.hidden_size, cfg.seq_length, cfg.num_layers
    # both versions: transformer flops set args.num_query_groups = num_attention_heads without GQA
    ng = cfg.num_query_groups if cfg.group_query_attention else nq
    batch_size = cfg.global_batch_size
    query_projection_size = cfg.kv_channels * nq
    ratio = query_projection_size / h
    if cfg.v013:
        # core_v0.13.0 training.py:num_floating_point_operations.transformer_flops: num_dense_layers = L,
        # num_moe_layers = 0, num_experts_routed_to = 0, mtp_num_layers = 0, moe_ffn_hidden_size = ffn,
        # shared_expert_ffn_hidden_size = 0, expansion_factor = 3 * 2 * 2.
        glu = 3 / 2 if cfg.swiglu else 1
        expansion_factor = 3 * 2 * 2
        num_dense_layers, num_moe_layers, routed, mtp, moe_ffn, shared_ffn = L, 0, 0, 0, cfg.ffn_hidden_size, 0
        self_attn_term = (expansion_factor * L * h * h
                          * ((1 + (ng / nq) + (s_len / h / 2)) * ratio))
        return (batch_size * s_len
                * (expansion_factor * L * h
                   * ((cfg.ffn_hidden_size * glu) * (num_dense_layers / L)
                      + (moe_ffn * routed * glu) * (num_moe_layers / L)
                      + (shared_ffn * glu) * (num_moe_layers / L))
                   + self_attn_term
                   + 3 * 2 * mtp * (3 * h + 2 * h * h)
                   + 3 * 2 * h * padded_vocab * (mtp + 1)))
    # core_v0.8.0 training.py:num_floating_point_operations
    glu = 3 / 2 if cfg.swiglu else 1
    return (12 * batch_size * s_len * L * h * h
            * (((1 + (ng / nq) + (s_len / h)) * ratio)
               + ((cfg.ffn_hidden_size / h) * 1 * glu)
               + (padded_vocab / (2 * L * h))))


def flops_so_far(cfg: ModelConfig) -> float:
    """save_checkpoint's num_floating_point_operations_so_far after `iteration` iterations of a fresh run
    (training.py:train starts from args.num_floating_point_operations_so_far = 0 (int) and adds one
    iteration's flops per step).  Computed with the TP=1 padded vocabulary so the value is the same for
    every topology of a variant (as if every topology were reshaped from the TP=1 run)."""
    per = num_floating_point_operations(cfg, padded_vocab_size(cfg, 1))
    total = 0
    for _ in range(cfg.iteration):
        total += per
    return total


def top_level_keys(cfg: ModelConfig, t: Topology) -> List[str]:
    """Key order of model_optim_rng.pt: checkpointing.py:generate_state_dict (args, checkpoint_version,
    iteration, model | model0..model{V-1} (len(model) > 1), optimizer, opt_param_scheduler, [v0.13:
    rerun_state_machine], rng_state) then save_checkpoint adds num_floating_point_operations_so_far."""
    model = ["model"] if t.vpp == 1 else [f"model{i}" for i in range(t.vpp)]
    out = ["args", "checkpoint_version", "iteration"] + model + ["optimizer", "opt_param_scheduler"]
    if cfg.v013:
        out.append("rerun_state_machine")
    return out + ["rng_state", "num_floating_point_operations_so_far"]


def rerun_state(cfg: ModelConfig) -> dict:
    """v0.13 'rerun_state_machine' entry (rerun_state_machine.py:RerunStateMachine.state_dict with
    ckpt_format 'torch': plain dict, 'sharded' not wrapped) of a run with the defaults --rerun-mode
    disabled, --error-injection-rate 0, --error-injection-type transient_error (initialize.py:
    initialize_megatron builds the machine from them), no --check-for-spiky-loss.  train() sets
    current_iteration = args.iteration (0) and every train step's should_run_forward_backward adds 1
    (NOT_RUNNING_YET -> INITIAL_RUN, back to NOT_RUNNING_YET on the second call), so after `iteration`
    steps: current_iteration = iteration, state NOT_RUNNING_YET; in DISABLED mode _sanitize_data_iterators
    returns [] -> data_iterator_checkpoints None.  Enums: ('__enum__', qualified class, member)."""
    enum = "megatron.core.rerun_state_machine."
    return {
        "mode": ("__enum__", enum + "RerunMode", "DISABLED"),
        "sharded": {
            "state": ("__enum__", enum + "RerunState", "NOT_RUNNING_YET"),
            "current_iteration": cfg.iteration,
            "rerun_requested": False,
            "checkpoint_requested": False,
            "restart_again_requested": False,
            "continue_requested": False,
            "error_injector_checkpoint": {
                "error_injection_rate": 0,
                "error_injection_type": ("__enum__", enum + "RerunDiagnostic", "TRANSIENT_ERROR"),
                "injected_error_type": None,
            },
            "failed_validation_call": None,
            "initial_result": None,
            "suspicious_node": None,
            "suspicious_device": None,
            "data_iterator_checkpoints": None,
            "large_value_counts": {},
            "max_values": {},
        },
    }


#: Attributes Megatron adds to args after parse_args()+validate_args() and before the save at iteration N,
#: in the order they are first set (appended to the Namespace __dict__); identical in v0.8 and v0.13:
#: training/tokenizer/tokenizer.py:build_tokenizer -> padded_vocab_size (global_vars.set_global_variables);
#: training.py:get_model -> model_type; setup_model_and_optimizer (no --load) -> iteration = 0,
#: num_floating_point_operations_so_far = 0; build_train_valid_test_data_loaders -> do_train/do_valid/do_test
#: (ints: False or flags[i].item()); train -> curr_iteration (= N - 1 at the save after step N).
def _added_args(cfg: ModelConfig, t: Topology) -> List[Tuple[str, object]]:
    return [
        ("padded_vocab_size", padded_vocab_size(cfg, t.tp)),
        ("model_type", ("__model_type__", "encoder_or_decoder")),
        ("iteration", 0),
        ("num_floating_point_operations_so_far", 0),
        ("do_train", 1), ("do_valid", 1), ("do_test", 1),
        ("curr_iteration", cfg.iteration - 1),
    ]


def args_items(cfg: ModelConfig, t: Topology, tp_rank: int, pp_rank: int) -> List[Tuple[str, object]]:
    """The ordered (name, value) pairs of the rank's ``args`` Namespace.

    Base: V013_ARGS_BASE / V08_ARGS_BASE (captured from parse_args()+validate_args() of that version, see
    the tables), then the variant's CLI flags and the topology, then the attributes Megatron adds while
    training (_added_args).  Values that depend on the run (the rest is the captured default):
      model / training flags   cfg (num_layers, hidden, ffn, heads, kv_channels, GQA, SwiGLU, bias, tied,
                               norm, position embedding, batch sizes, lr schedule, seed, vocab (NullTokenizer
                               --vocab-size V-1: the tokenizer adds the EOD token))
      validate_args couplings  bias_gelu_fusion = False without add_bias_linear (both); v0.13: add_qkv_bias =
                               True with add_bias_linear, apply_rope_fusion = False unless rope,
                               expert_tensor_parallel_size = TP
      topology                 tensor/pipeline(/transformer_pipeline)_model_parallel_size, VPP
                               (--num-layers-per-virtual-pipeline-stage L/PP/VPP ->
                               virtual_pipeline_model_parallel_size), overlap_p2p_comm (overlap_p2p_comm()),
                               v0.13 align_param_gather = (VPP > 1), use_distributed_optimizer,
                               data_parallel_size, world_size (= TP*PP*DP; v0.13 also
                               inprocess_active_world_size = WORLD_SIZE), rank = global rank of the saving
                               rank (DP rank 0), local_rank = rank % 8 (torchrun, 8 GPUs per node)
      training                 lr_decay_iters = train_iters (get_optimizer_param_scheduler); MHA:
                               num_query_groups = heads (num_floating_point_operations); consumed_train_samples
                               = N * global batch
    DP therefore reaches every rank file through data_parallel_size, world_size, rank (PP rank > 0),
    local_rank and (v0.13) inprocess_active_world_size, even where the tensors do not depend on DP.
    v0.13 args verified field by field against parse_args()+validate_args() of core_v0.13.0 for all 270
    variant x topology combinations of the full grid (WORLD_SIZE/RANK/LOCAL_RANK set as torchrun does).
    Values that are torch dtypes / Megatron enums are ('__torch_dtype__', name) / ('__model_type__', name) /
    ('__enum__', qualified class, member).
    """
    import copy
    base = V013_ARGS_BASE if cfg.v013 else V08_ARGS_BASE
    d = copy.deepcopy(dict(base))
    order = [k for k, _ in base]
    rank = global_rank(t, tp_rank, pp_rank, 0)
    upd = {
        "num_layers": cfg.num_layers, "encoder_num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": cfg.ffn_hidden_size, "num_attention_heads": cfg.num_attention_heads,
        "kv_channels": cfg.kv_channels, "group_query_attention": cfg.group_query_attention,
        "num_query_groups": cfg.num_query_groups if cfg.group_query_attention else cfg.num_attention_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "position_embedding_type": cfg.position_embedding_type,
        "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by,
        "normalization": cfg.normalization, "swiglu": cfg.swiglu,
        "untie_embeddings_and_output_weights": cfg.untie_embeddings_and_output_weights,
        "add_bias_linear": cfg.add_bias_linear,
        "bias_gelu_fusion": bool(d["bias_gelu_fusion"] and cfg.add_bias_linear),  # validate_args
        "weight_decay": cfg.weight_decay, "start_weight_decay": cfg.weight_decay,
        "end_weight_decay": cfg.weight_decay, "adam_beta1": cfg.adam_beta1, "adam_beta2": cfg.adam_beta2,
        "adam_eps": cfg.adam_eps, "micro_batch_size": cfg.micro_batch_size,
        "global_batch_size": cfg.global_batch_size, "train_iters": cfg.train_iters, "lr": cfg.lr,
        "min_lr": cfg.min_lr, "lr_warmup_iters": cfg.lr_warmup_iters, "lr_decay_iters": cfg.train_iters,
        "seed": cfg.seed, "vocab_size": cfg.vocab_size - 1,   # NullTokenizer adds the EOD token
        "seq_length": cfg.seq_length, "encoder_seq_length": cfg.seq_length,
        "tensor_model_parallel_size": t.tp, "pipeline_model_parallel_size": t.pp,
        "transformer_pipeline_model_parallel_size": t.pp,
        "num_layers_per_virtual_pipeline_stage": (cfg.num_layers // t.pp // t.vpp) if t.vpp > 1 else None,
        "virtual_pipeline_model_parallel_size": t.vpp if t.vpp > 1 else None,
        "overlap_p2p_comm": overlap_p2p_comm(cfg, t),
        "use_distributed_optimizer": t.distopt, "data_parallel_size": t.dp, "world_size": t.world_size,
        "rank": rank, "local_rank": rank % 8,
        "sequence_parallel": False,
        "consumed_train_samples": cfg.iteration * cfg.global_batch_size,
        # '--overlap-grad-reduce' (store_true), '--ddp-bucket-size' (default None)
        "overlap_grad_reduce": cfg.ddp_bucket_size is not None,
        "ddp_bucket_size": cfg.ddp_bucket_size,
    }
    if cfg.v013:
        upd.update({
            # arguments.py:validate_args: "if args.add_bias_linear: args.add_qkv_bias = True" (parser
            # default False, no --add-qkv-bias here)
            "add_qkv_bias": cfg.add_bias_linear,
            # '--no-rope-fusion' (store_false, default True); validate_args: "if args.position_embedding_type
            # != 'rope': args.apply_rope_fusion = False"
            "apply_rope_fusion": cfg.position_embedding_type == "rope",
            # "if args.expert_tensor_parallel_size is None: ... = args.tensor_model_parallel_size"
            "expert_tensor_parallel_size": t.tp,
            # align_param_gather ('--no-align-param-gather', default True) forced False without VPP
            "align_param_gather": t.vpp > 1,
            # '--inprocess-active-world-size' default int(os.getenv('WORLD_SIZE', '1'))
            "inprocess_active_world_size": t.world_size,
        })
    for k, v in upd.items():
        if k not in d:
            raise KeyError(k)
        d[k] = v
    out = [(k, d[k]) for k in order]
    return out + _added_args(cfg, t)


#: Fields whose equality matters when Megatron loads a legacy checkpoint (check_checkpoint_args, the
#: model builder, DistributedOptimizer.load_parameter_state) plus the iteration bookkeeping.
LOAD_RELEVANT_ARGS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "data_parallel_size", "world_size", "padded_vocab_size",
    "use_distributed_optimizer", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "ffn_hidden_size", "swiglu", "add_bias_linear",
    "untie_embeddings_and_output_weights", "normalization", "position_embedding_type",
    "max_position_embeddings", "make_vocab_size_divisible_by", "params_dtype", "bf16",
    "iteration", "consumed_train_samples", "consumed_valid_samples", "train_iters", "global_batch_size",
)


# ----------------------------------------------------------------------------------------------------
# Legacy GPT names (megatron/legacy/model, Megatron-LM 23.06) — used to verify the splitting rules
# against the real fixtures in shared/fixtures/megatron-23.06.


@dataclasses.dataclass(frozen=True)
class LegacyConfig:
    num_layers: int
    hidden_size: int
    padded_vocab: int
    tied: bool = True
    add_bias: bool = True
    position_embedding: bool = True


def legacy_layer_params(g: int) -> List[Tuple[str, str, str]]:
    """(local suffix, converter message key, split) of legacy ParallelTransformerLayer g
    (megatron/model/transformer.py registration order: input_layernorm, self_attention.query_key_value,
    self_attention.dense, post_attention_layernorm, mlp.dense_h_to_4h, mlp.dense_4h_to_h).  The full
    tensors are keyed like tools/checkpoint's queue messages ("transformer layer N/qkv weight")."""
    m = f"transformer layer {g}/"
    return [
        ("input_layernorm.weight", m + "input layernorm weight", "replicated"),
        ("input_layernorm.bias", m + "input layernorm bias", "replicated"),
        ("self_attention.query_key_value.weight", m + "qkv weight", "dim0"),
        ("self_attention.query_key_value.bias", m + "qkv bias", "dim0"),
        ("self_attention.dense.weight", m + "dense weight", "dim1"),
        ("self_attention.dense.bias", m + "dense bias", "replicated"),
        ("post_attention_layernorm.weight", m + "post layernorm weight", "replicated"),
        ("post_attention_layernorm.bias", m + "post layernorm bias", "replicated"),
        ("mlp.dense_h_to_4h.weight", m + "mlp l0 weight", "dim0"),
        ("mlp.dense_h_to_4h.bias", m + "mlp l0 bias", "dim0"),
        ("mlp.dense_4h_to_h.weight", m + "mlp l1 weight", "dim1"),
        ("mlp.dense_4h_to_h.bias", m + "mlp l1 bias", "replicated"),
    ]


def legacy_model_layout(cfg: LegacyConfig, tp: int, pp: int, pp_rank: int) -> List[Tuple[Tuple[str, ...], str, str]]:
    """[(path of nested keys, full-tensor key, split)] of a legacy GPT rank's `model`, in order.
    Nesting (megatron/model/gpt_model.py & language_model.py state_dict_for_save_checkpoint):
    {'language_model': {'embedding': {'word_embeddings': {'weight'}, 'position_embeddings': {'weight'}},
                        'encoder': {'layers.N....', 'final_layernorm.*'}},
     'word_embeddings_for_head': {'weight'}}   (the latter on the last stage when tied and PP > 1)."""
    n = cfg.num_layers // pp
    first, last = pp_rank == 0, pp_rank == pp - 1
    out: List[Tuple[Tuple[str, ...], str, str]] = []
    if first:
        out.append((("language_model", "embedding", "word_embeddings", "weight"),
                    "embeddings/word embeddings", "dim0"))
        if cfg.position_embedding:
            out.append((("language_model", "embedding", "position_embeddings", "weight"),
                        "embeddings/position embeddings", "replicated"))
    for local in range(n):
        g = pp_rank * n + local
        for suffix, key, split in legacy_layer_params(g):
            out.append((("language_model", "encoder", f"layers.{local}.{suffix}"), key, split))
    if last:
        out.append((("language_model", "encoder", "final_layernorm.weight"), "final layernorm/weight", "replicated"))
        out.append((("language_model", "encoder", "final_layernorm.bias"), "final layernorm/bias", "replicated"))
        if cfg.tied and not first:
            out.append((("word_embeddings_for_head", "weight"), "embeddings/word embeddings", "dim0"))
    return out


def legacy_module_metadata(path: Tuple[str, ...], n_layers_local: int, last_stage: bool) -> List[str]:
    """_metadata keys of a legacy sub-state-dict (each nested level is a separate module.state_dict();
    the encoder's is ParallelTransformer's module tree, final_layernorm on the last stage only)."""
    leaf = path[-2] if len(path) >= 2 else ""
    if leaf != "encoder":
        return [""]
    out = ["", "layers"]
    for i in range(n_layers_local):
        p = f"layers.{i}"
        out += [p, p + ".input_layernorm", p + ".self_attention", p + ".self_attention.query_key_value",
                p + ".self_attention.core_attention", p + ".self_attention.core_attention.scale_mask_softmax",
                p + ".self_attention.core_attention.attention_dropout", p + ".self_attention.dense",
                p + ".post_attention_layernorm", p + ".mlp", p + ".mlp.dense_h_to_4h", p + ".mlp.dense_4h_to_h"]
    if last_stage:
        out.append("final_layernorm")
    return out


# ----------------------------------------------------------------------------------------------------
# Captured from Megatron-LM core_v0.8.0 by running megatron/training/arguments.py parse_args() and
# validate_args() (untouched, from a `git archive core_v0.8.0 megatron` tree, regex stubbed out) with
#   pretrain_gpt.py --num-layers 8 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 8
#   --kv-channels 4 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 16
#   --train-iters 1000 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 10
#   --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02 --bf16
#   --tokenizer-type NullTokenizer --vocab-size 129 --make-vocab-size-divisible-by 32
#   --save /checkpoints/megagen --save-interval 100 --eval-interval 1000 --eval-iters 10 --mock-data
#   --seed 1234 --log-interval 10
# (WORLD_SIZE=1, CUDA_DEVICE_MAX_CONNECTIONS=1).  Order = the Namespace's attribute order.  Variant and
# topology specific values are replaced by args_items().
V08_ARGS_BASE: List[Tuple[str, object]] = [
    ('num_layers', 8),
    ('encoder_num_layers', 8),
    ('decoder_num_layers', None),
    ('hidden_size', 32),
    ('ffn_hidden_size', 64),
    ('num_attention_heads', 8),
    ('kv_channels', 4),
    ('group_query_attention', False),
    ('num_query_groups', 1),
    ('max_position_embeddings', 16),
    ('position_embedding_type', 'learned_absolute'),
    ('use_rotary_position_embeddings', False),
    ('rotary_base', 10000),
    ('rotary_percent', 1.0),
    ('rotary_interleaved', False),
    ('rotary_seq_len_interpolation_factor', None),
    ('add_position_embedding', True),
    ('make_vocab_size_divisible_by', 32),
    ('normalization', 'LayerNorm'),
    ('norm_epsilon', 1e-05),
    ('apply_layernorm_1p', False),
    ('apply_residual_connection_post_layernorm', False),
    ('openai_gelu', False),
    ('squared_relu', False),
    ('swiglu', False),
    ('onnx_safe', None),
    ('bert_binary_head', True),
    ('untie_embeddings_and_output_weights', False),
    ('attention_dropout', 0.1),
    ('hidden_dropout', 0.1),
    ('weight_decay', 0.1),
    ('start_weight_decay', 0.1),
    ('end_weight_decay', 0.1),
    ('weight_decay_incr_style', 'constant'),
    ('clip_grad', 1.0),
    ('adam_beta1', 0.9),
    ('adam_beta2', 0.95),
    ('adam_eps', 1e-08),
    ('sgd_momentum', 0.9),
    ('micro_batch_size', 2),
    ('global_batch_size', 16),
    ('rampup_batch_size', None),
    ('recompute_granularity', None),
    ('check_for_nan_in_loss_and_grad', True),
    ('distribute_saved_activations', False),
    ('recompute_method', None),
    ('recompute_num_layers', None),
    ('clone_scatter_output_in_embedding', True),
    ('profile', False),
    ('profile_step_start', 10),
    ('profile_step_end', 12),
    ('profile_ranks', [0]),
    ('tp_comm_overlap', False),
    ('tp_comm_overlap_cfg', None),
    ('tp_comm_overlap_ag', True),
    ('tp_comm_overlap_rs', True),
    ('tp_comm_overlap_rs_dgrad', False),
    ('tp_comm_bulk_dgrad', True),
    ('tp_comm_bulk_wgrad', True),
    ('use_cpu_initialization', None),
    ('empty_unused_memory_level', 0),
    ('deterministic_mode', False),
    ('check_weight_hash_across_dp_replicas_interval', None),
    ('calculate_per_token_loss', False),
    ('train_iters', 1000),
    ('train_samples', None),
    ('log_interval', 10),
    ('exit_interval', None),
    ('exit_duration_in_mins', None),
    ('exit_signal_handler', False),
    ('tensorboard_dir', None),
    ('masked_softmax_fusion', True),
    ('bias_gelu_fusion', True),
    ('bias_swiglu_fusion', True),
    ('bias_dropout_fusion', True),
    ('apply_rope_fusion', True),
    ('cross_entropy_loss_fusion', False),
    ('use_flash_attn', False),
    ('add_bias_linear', True),
    ('add_qkv_bias', False),
    ('optimizer', 'adam'),
    ('dataloader_type', 'single'),
    ('async_tensor_model_parallel_allreduce', True),
    ('no_persist_layer_norm', False),
    ('sequence_parallel', False),
    ('gradient_accumulation_fusion', True),
    ('deprecated_use_mcore_models', False),
    ('use_legacy_models', False),
    ('manual_gc', False),
    ('manual_gc_interval', 0),
    ('manual_gc_eval', True),
    ('tp_comm_split_ag', True),
    ('tp_comm_split_rs', True),
    ('seed', 1234),
    ('data_parallel_random_init', False),
    ('init_method_std', 0.02),
    ('init_method_xavier_uniform', False),
    ('lr', 0.0003),
    ('lr_decay_style', 'cosine'),
    ('lr_wsd_decay_style', 'exponential'),
    ('lr_decay_iters', None),
    ('lr_decay_samples', None),
    ('lr_wsd_decay_samples', None),
    ('lr_wsd_decay_iters', None),
    ('lr_warmup_fraction', None),
    ('lr_warmup_iters', 10),
    ('lr_warmup_samples', 0),
    ('lr_warmup_init', 0.0),
    ('min_lr', 3e-05),
    ('override_opt_param_scheduler', False),
    ('use_checkpoint_opt_param_scheduler', False),
    ('decoupled_lr', None),
    ('decoupled_min_lr', None),
    ('save', '/checkpoints/megagen'),
    ('save_interval', 100),
    ('no_save_optim', None),
    ('no_save_rng', None),
    ('load', None),
    ('no_load_optim', None),
    ('no_load_rng', None),
    ('finetune', False),
    ('pretrained_checkpoint', None),
    ('ckpt_step', None),
    ('perform_initialization', True),
    ('use_checkpoint_args', False),
    ('exit_on_missing_checkpoint', False),
    ('use_dist_ckpt', False),
    ('auto_detect_ckpt_format', False),
    ('dist_ckpt_format', 'torch_dist'),
    ('ckpt_fully_parallel_save_deprecated', False),
    ('ckpt_fully_parallel_save', True),
    ('async_save', None),
    ('ckpt_fully_parallel_load', False),
    ('ckpt_assume_constant_structure', False),
    ('dist_ckpt_strictness', 'assume_ok_unexpected'),
    ('fp16', False),
    ('bf16', True),
    ('loss_scale', None),
    ('initial_loss_scale', 4294967296),
    ('min_loss_scale', 1.0),
    ('loss_scale_window', 1000),
    ('hysteresis', 2),
    ('fp32_residual_connection', False),
    ('apply_query_key_layer_scaling', False),
    ('attention_softmax_in_fp32', False),
    ('accumulate_allreduce_grads_in_fp32', True),
    ('fp16_lm_cross_entropy', False),
    ('tensor_model_parallel_size', 1),
    ('pipeline_model_parallel_size', 1),
    ('pipeline_model_parallel_split_rank', None),
    ('num_layers_per_virtual_pipeline_stage', None),
    ('overlap_p2p_comm', False),
    ('distributed_backend', 'nccl'),
    ('distributed_timeout_minutes', 10),
    ('overlap_grad_reduce', False),
    ('defer_embedding_wgrad_compute', False),
    ('wgrad_deferral_limit', 0),
    ('delay_grad_reduce', True),
    ('ddp_bucket_size', None),
    ('ddp_average_in_collective', False),
    ('overlap_param_gather', False),
    ('delay_param_gather', False),
    ('scatter_gather_tensors_in_pipeline', True),
    ('use_ring_exchange_p2p', False),
    ('local_rank', None),
    ('lazy_mpu_init', None),
    ('standalone_embedding_stage', False),
    ('use_distributed_optimizer', False),
    ('context_parallel_size', 1),
    ('nccl_communicator_config_path', None),
    ('use_tp_pp_dp_mapping', False),
    ('eval_iters', 10),
    ('eval_interval', 1000),
    ('test_mode', False),
    ('skip_train', False),
    ('data_path', None),
    ('split', None),
    ('train_data_path', None),
    ('valid_data_path', None),
    ('test_data_path', None),
    ('data_cache_path', None),
    ('mmap_bin_files', True),
    ('mock_data', True),
    ('vocab_size', 129),
    ('vocab_file', None),
    ('merge_file', None),
    ('vocab_extra_ids', 0),
    ('seq_length', 16),
    ('encoder_seq_length', 16),
    ('decoder_seq_length', None),
    ('retriever_seq_length', 256),
    ('sample_rate', 1.0),
    ('mask_prob', 0.15),
    ('short_seq_prob', 0.1),
    ('num_workers', 2),
    ('tokenizer_type', 'NullTokenizer'),
    ('tokenizer_model', None),
    ('tiktoken_pattern', None),
    ('tiktoken_num_special_tokens', 1000),
    ('tiktoken_special_tokens', None),
    ('reset_position_ids', False),
    ('reset_attention_mask', False),
    ('eod_mask_loss', False),
    ('create_attention_mask_in_dataloader', True),
    ('num_dataset_builder_threads', 1),
    ('s3_cache_path', None),
    ('adlr_autoresume', False),
    ('adlr_autoresume_interval', 1000),
    ('ict_head_size', None),
    ('biencoder_projection_dim', 0),
    ('biencoder_shared_query_context_model', False),
    ('ict_load', None),
    ('bert_load', None),
    ('titles_data_path', None),
    ('query_in_block_prob', 0.1),
    ('use_one_sent_docs', False),
    ('evidence_data_path', None),
    ('retriever_report_topk_accuracies', []),
    ('retriever_score_scaling', False),
    ('block_data_path', None),
    ('embedding_path', None),
    ('indexer_batch_size', 128),
    ('indexer_log_interval', 1000),
    ('num_classes', 1000),
    ('img_h', 224),
    ('img_w', 224),
    ('num_channels', 3),
    ('patch_dim', 16),
    ('classes_fraction', 1.0),
    ('data_per_class_fraction', 1.0),
    ('data_sharding', True),
    ('head_lr_mult', 1.0),
    ('vision_pretraining', False),
    ('vision_pretraining_type', 'classify'),
    ('vision_backbone_type', 'vit'),
    ('swin_backbone_type', 'tiny'),
    ('mask_type', 'random'),
    ('mask_factor', 1.0),
    ('iter_per_epoch', 1250),
    ('dino_local_img_size', 96),
    ('dino_local_crops_number', 10),
    ('dino_head_hidden_size', 2048),
    ('dino_bottleneck_size', 256),
    ('dino_freeze_last_layer', 1),
    ('dino_norm_last_layer', False),
    ('dino_warmup_teacher_temp', 0.04),
    ('dino_teacher_temp', 0.07),
    ('dino_warmup_teacher_temp_epochs', 30),
    ('qk_layernorm', False),
    ('expert_model_parallel_size', 1),
    ('num_experts', None),
    ('moe_router_load_balancing_type', 'aux_loss'),
    ('moe_router_topk', 2),
    ('moe_router_pre_softmax', False),
    ('moe_grouped_gemm', False),
    ('moe_aux_loss_coeff', 0.0),
    ('moe_z_loss_coeff', None),
    ('moe_input_jitter_eps', None),
    ('moe_token_dispatcher_type', 'allgather'),
    ('moe_per_layer_logging', False),
    ('moe_expert_capacity_factor', None),
    ('moe_pad_expert_input_to_capacity', False),
    ('moe_token_drop_policy', 'probs'),
    ('moe_layer_recompute', False),
    ('moe_extended_tp', False),
    ('log_params_norm', False),
    ('log_num_zeros_in_grad', False),
    ('log_throughput', False),
    ('log_progress', False),
    ('timing_log_level', 0),
    ('barrier_with_L1_time', True),
    ('timing_log_option', 'minmax'),
    ('tensorboard_log_interval', 1),
    ('tensorboard_queue_size', 1000),
    ('log_timers_to_tensorboard', False),
    ('log_batch_size_to_tensorboard', False),
    ('log_learning_rate_to_tensorboard', True),
    ('log_loss_scale_to_tensorboard', True),
    ('log_validation_ppl_to_tensorboard', False),
    ('log_memory_to_tensorboard', False),
    ('log_world_size_to_tensorboard', False),
    ('wandb_project', ''),
    ('wandb_exp_name', ''),
    ('wandb_save_dir', ''),
    ('logging_level', None),
    ('log_straggler', False),
    ('disable_straggler_on_startup', False),
    ('straggler_ctrlr_port', 65535),
    ('straggler_minmax_count', 1),
    ('inference_batch_times_seqlen_threshold', 512),
    ('max_tokens_to_oom', 12000),
    ('output_bert_embeddings', False),
    ('bert_embedder_type', 'megatron'),
    ('fp8', None),
    ('fp8_margin', 0),
    ('fp8_interval', 1),
    ('fp8_amax_history_len', 1),
    ('fp8_amax_compute_algo', 'most_recent'),
    ('fp8_wgrad', True),
    ('transformer_impl', 'transformer_engine'),
    ('retro_project_dir', None),
    ('retro_add_retriever', False),
    ('retro_cyclic_train_iters', None),
    ('retro_encoder_layers', 2),
    ('retro_encoder_hidden_dropout', 0.1),
    ('retro_encoder_attention_dropout', 0.1),
    ('retro_num_neighbors', 2),
    ('retro_num_retrieved_chunks', 2),
    ('retro_attention_gate', 1),
    ('retro_verify_neighbor_count', True),
    ('spec', None),
    ('hybrid_attention_ratio', 0.0),
    ('hybrid_mlp_ratio', 0.0),
    ('hybrid_override_pattern', None),
    ('yaml_cfg', None),
    ('enable_one_logger', True),
    ('one_logger_project', 'megatron-lm'),
    ('one_logger_run_name', None),
    ('one_logger_async', False),
    ('app_tag_run_name', None),
    ('app_tag_run_version', '0.0.0'),
    ('rank', 0),
    ('world_size', 1),
    ('transformer_pipeline_model_parallel_size', 1),
    ('data_parallel_size', 1),
    ('virtual_pipeline_model_parallel_size', None),
    ('params_dtype', ('__torch_dtype__', 'bfloat16')),
    ('consumed_train_samples', 0),
    ('consumed_valid_samples', 0),
    ('variable_seq_lengths', False),
]


# ----------------------------------------------------------------------------------------------------
# Captured from Megatron-LM core_v0.13.0 the same way: megatron/training/arguments.py parse_args() and
# validate_args() run untouched from a `git archive core_v0.13.0 megatron` tree under Debian's python3 +
# torch 1.13, with the modules arguments.py imports but does not need for these flags replaced by stand-ins
# (dist_checkpointing.validation.StrictHandling, rerun_state_machine.RerunStateMachine, TransformerConfig,
# PipelineParallelLayerLayout, heterogeneous config, quantization utils; megatron.core.utils
# is_torch_min_version -> True (NGC torch >= 2.x), training.utils get_device_arch_version -> 9 (Hopper),
# update_use_dist_ckpt as in the source; transformer/enums.py, models/retro/utils.py, msc_utils.py real),
# with the same CLI as V08_ARGS_BASE plus `--ckpt-format torch` (v0.13's default format is torch_dist),
# env WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 CUDA_DEVICE_MAX_CONNECTIONS=1.  The same harness reproduces
# V08_ARGS_BASE exactly from a core_v0.8.0 tree.  Order = the Namespace's attribute order; run-specific
# values are replaced by args_items().
V013_ARGS_BASE: List[Tuple[str, object]] = [
    ('num_layers', 8),
    ('encoder_num_layers', 8),
    ('decoder_num_layers', None),
    ('hidden_size', 32),
    ('ffn_hidden_size', 64),
    ('num_attention_heads', 8),
    ('attention_backend', ('__enum__', 'megatron.core.transformer.enums.AttnBackend', 'auto')),
    ('kv_channels', 4),
    ('group_query_attention', False),
    ('num_query_groups', 1),
    ('max_position_embeddings', 16),
    ('position_embedding_type', 'learned_absolute'),
    ('relative_attention_num_buckets', 32),
    ('relative_attention_max_distance', 128),
    ('use_rotary_position_embeddings', False),
    ('rotary_base', 10000),
    ('rotary_percent', 1.0),
    ('rotary_interleaved', False),
    ('rotary_seq_len_interpolation_factor', None),
    ('use_rope_scaling', False),
    ('rope_scaling_factor', 8.0),
    ('no_rope_freq', None),
    ('add_position_embedding', True),
    ('mrope_section', None),
    ('make_vocab_size_divisible_by', 32),
    ('normalization', 'LayerNorm'),
    ('norm_epsilon', 1e-05),
    ('apply_layernorm_1p', False),
    ('apply_residual_connection_post_layernorm', False),
    ('openai_gelu', False),
    ('squared_relu', False),
    ('swiglu', False),
    ('onnx_safe', None),
    ('bert_binary_head', True),
    ('untie_embeddings_and_output_weights', False),
    ('multi_latent_attention', False),
    ('mtp_num_layers', None),
    ('mtp_loss_scaling_factor', 0.1),
    ('attention_dropout', 0.1),
    ('hidden_dropout', 0.1),
    ('weight_decay', 0.1),
    ('start_weight_decay', 0.1),
    ('end_weight_decay', 0.1),
    ('weight_decay_incr_style', 'constant'),
    ('clip_grad', 1.0),
    ('adam_beta1', 0.9),
    ('adam_beta2', 0.95),
    ('adam_eps', 1e-08),
    ('sgd_momentum', 0.9),
    ('micro_batch_size', 2),
    ('global_batch_size', 16),
    ('rampup_batch_size', None),
    ('decrease_batch_size_if_needed', False),
    ('recompute_granularity', None),
    ('check_for_nan_in_loss_and_grad', True),
    ('check_for_spiky_loss', False),
    ('check_for_large_grads', False),
    ('distribute_saved_activations', False),
    ('recompute_method', None),
    ('recompute_num_layers', None),
    ('recompute_modules', None),
    ('clone_scatter_output_in_embedding', True),
    ('profile', False),
    ('profile_step_start', 10),
    ('profile_step_end', 12),
    ('iterations_to_skip', []),
    ('result_rejected_tracker_filename', None),
    ('enable_gloo_process_groups', True),
    ('use_pytorch_profiler', False),
    ('profile_ranks', [0]),
    ('record_memory_history', False),
    ('memory_snapshot_path', 'snapshot.pickle'),
    ('tp_comm_overlap', False),
    ('tp_comm_overlap_cfg', None),
    ('tp_comm_overlap_ag', True),
    ('tp_comm_overlap_rs', True),
    ('tp_comm_overlap_rs_dgrad', False),
    ('tp_comm_bulk_dgrad', True),
    ('tp_comm_bulk_wgrad', True),
    ('tp_comm_bootstrap_backend', 'nccl'),
    ('use_cpu_initialization', None),
    ('empty_unused_memory_level', 0),
    ('deterministic_mode', False),
    ('check_weight_hash_across_dp_replicas_interval', None),
    ('calculate_per_token_loss', False),
    ('train_sync_interval', None),
    ('train_iters', 1000),
    ('train_samples', None),
    ('log_interval', 10),
    ('exit_interval', None),
    ('exit_duration_in_mins', None),
    ('exit_signal_handler', False),
    ('tensorboard_dir', None),
    ('masked_softmax_fusion', True),
    ('bias_gelu_fusion', True),
    ('bias_swiglu_fusion', True),
    ('bias_dropout_fusion', True),
    ('apply_rope_fusion', False),
    ('cross_entropy_loss_fusion', False),
    ('cross_entropy_fusion_impl', 'native'),
    ('use_flash_attn', False),
    ('add_bias_linear', True),
    ('add_qkv_bias', True),
    ('optimizer', 'adam'),
    ('optimizer_cpu_offload', False),
    ('optimizer_offload_fraction', 1.0),
    ('use_torch_optimizer_for_cpu_offload', False),
    ('overlap_cpu_optimizer_d2h_h2d', False),
    ('pin_cpu_grads', True),
    ('pin_cpu_params', True),
    ('dataloader_type', 'single'),
    ('async_tensor_model_parallel_allreduce', True),
    ('no_persist_layer_norm', False),
    ('sequence_parallel', False),
    ('gradient_accumulation_fusion', True),
    ('deprecated_use_mcore_models', False),
    ('use_legacy_models', False),
    ('manual_gc', False),
    ('manual_gc_interval', 0),
    ('manual_gc_eval', True),
    ('tp_comm_split_ag', True),
    ('tp_comm_split_rs', True),
    ('pipeline_model_parallel_comm_backend', None),
    ('high_priority_stream_groups', []),
    ('seed', 1234),
    ('data_parallel_random_init', False),
    ('init_method_std', 0.02),
    ('init_method_xavier_uniform', False),
    ('lr', 0.0003),
    ('lr_decay_style', 'cosine'),
    ('lr_wsd_decay_style', 'exponential'),
    ('lr_decay_iters', None),
    ('lr_decay_samples', None),
    ('lr_wsd_decay_samples', None),
    ('lr_wsd_decay_iters', None),
    ('lr_warmup_fraction', None),
    ('lr_warmup_iters', 10),
    ('lr_warmup_samples', 0),
    ('lr_warmup_init', 0.0),
    ('min_lr', 3e-05),
    ('override_opt_param_scheduler', False),
    ('use_checkpoint_opt_param_scheduler', False),
    ('decoupled_lr', None),
    ('decoupled_min_lr', None),
    ('save', '/checkpoints/megagen'),
    ('save_interval', 100),
    ('no_save_optim', None),
    ('no_save_rng', None),
    ('load', None),
    ('no_load_optim', None),
    ('no_load_rng', None),
    ('non_persistent_save_interval', None),
    ('non_persistent_ckpt_type', None),
    ('non_persistent_global_ckpt_dir', None),
    ('non_persistent_local_ckpt_dir', None),
    ('non_persistent_local_ckpt_algo', 'fully_parallel'),
    ('finetune', False),
    ('pretrained_checkpoint', None),
    ('ckpt_step', None),
    ('perform_initialization', True),
    ('use_checkpoint_args', False),
    ('use_mp_args_from_checkpoint_args', False),
    ('use_tokenizer_model_from_checkpoint_args', True),
    ('exit_on_missing_checkpoint', False),
    ('use_dist_ckpt_deprecated', False),
    ('use_persistent_ckpt_worker', False),
    ('auto_detect_ckpt_format', False),
    ('dist_ckpt_format_deprecated', None),
    ('ckpt_format', 'torch'),
    ('ckpt_convert_format', None),
    ('ckpt_convert_save', None),
    ('ckpt_convert_update_legacy_dist_opt_format', False),
    ('ckpt_fully_parallel_save_deprecated', False),
    ('ckpt_fully_parallel_save', True),
    ('async_save', None),
    ('ckpt_fully_parallel_load', False),
    ('ckpt_assume_constant_structure', False),
    ('dist_ckpt_strictness', 'assume_ok_unexpected'),
    ('load_model_opt_format', False),
    ('fp16', False),
    ('bf16', True),
    ('grad_reduce_in_bf16', False),
    ('loss_scale', None),
    ('initial_loss_scale', 4294967296),
    ('min_loss_scale', 1.0),
    ('loss_scale_window', 1000),
    ('hysteresis', 2),
    ('fp32_residual_connection', False),
    ('apply_query_key_layer_scaling', False),
    ('attention_softmax_in_fp32', False),
    ('accumulate_allreduce_grads_in_fp32', True),
    ('fp16_lm_cross_entropy', False),
    ('disable_bf16_reduced_precision_matmul', False),
    ('reuse_grad_buf_for_mxfp8_param_ag', False),
    ('tensor_model_parallel_size', 1),
    ('encoder_tensor_model_parallel_size', 0),
    ('pipeline_model_parallel_size', 1),
    ('encoder_pipeline_model_parallel_size', 0),
    ('pipeline_model_parallel_split_rank', None),
    ('decoder_first_pipeline_num_layers', None),
    ('decoder_last_pipeline_num_layers', None),
    ('pipeline_model_parallel_layout', None),
    ('num_layers_per_virtual_pipeline_stage', None),
    ('num_virtual_stages_per_pipeline_rank', None),
    ('microbatch_group_size_per_vp_stage', None),
    ('overlap_p2p_comm', False),
    ('overlap_p2p_comm_warmup_flush', False),
    ('distributed_backend', 'nccl'),
    ('distributed_timeout_minutes', 10),
    ('overlap_grad_reduce', False),
    ('defer_embedding_wgrad_compute', False),
    ('wgrad_deferral_limit', 0),
    ('align_grad_reduce', True),
    ('ddp_num_buckets', None),
    ('ddp_bucket_size', None),
    ('ddp_pad_buckets_for_high_nccl_busbw', False),
    ('ddp_average_in_collective', False),
    ('overlap_param_gather', False),
    ('overlap_param_gather_with_optimizer_step', False),
    ('align_param_gather', False),
    ('scatter_gather_tensors_in_pipeline', True),
    ('use_ring_exchange_p2p', False),
    ('local_rank', 0),
    ('lazy_mpu_init', None),
    ('account_for_embedding_in_pipeline_split', False),
    ('account_for_loss_in_pipeline_split', False),
    ('use_distributed_optimizer', False),
    ('nccl_ub', False),
    ('use_sharp', False),
    ('use_custom_fsdp', False),
    ('init_model_with_meta_device', False),
    ('data_parallel_sharding_strategy', 'no_shard'),
    ('gradient_reduce_div_fusion', True),
    ('fsdp_double_buffer', False),
    ('suggested_communication_unit_size', None),
    ('keep_fp8_transpose_cache_when_using_custom_fsdp', False),
    ('num_distributed_optimizer_instances', 1),
    ('use_torch_fsdp2', False),
    ('torch_fsdp2_reshard_after_forward', True),
    ('context_parallel_size', 1),
    ('cp_comm_type', ['p2p']),
    ('hierarchical_context_parallel_sizes', None),
    ('nccl_communicator_config_path', None),
    ('use_tp_pp_dp_mapping', False),
    ('replication', False),
    ('replication_jump', None),
    ('replication_factor', 2),
    ('eval_iters', 10),
    ('eval_interval', 1000),
    ('test_mode', False),
    ('skip_train', False),
    ('data_path', None),
    ('split', None),
    ('train_data_path', None),
    ('valid_data_path', None),
    ('test_data_path', None),
    ('data_args_path', None),
    ('per_split_data_args_path', None),
    ('data_cache_path', None),
    ('mmap_bin_files', True),
    ('mock_data', True),
    ('seq_length', 16),
    ('encoder_seq_length', 16),
    ('decoder_seq_length', None),
    ('retriever_seq_length', 256),
    ('sample_rate', 1.0),
    ('mask_prob', 0.15),
    ('short_seq_prob', 0.1),
    ('num_workers', 2),
    ('reset_position_ids', False),
    ('reset_attention_mask', False),
    ('eod_mask_loss', False),
    ('create_attention_mask_in_dataloader', True),
    ('num_dataset_builder_threads', 1),
    ('object_storage_cache_path', None),
    ('mid_level_dataset_surplus', 0.005),
    ('vocab_size', 129),
    ('vocab_file', None),
    ('merge_file', None),
    ('vocab_extra_ids', 0),
    ('tokenizer_type', 'NullTokenizer'),
    ('tokenizer_model', None),
    ('tiktoken_pattern', None),
    ('tiktoken_num_special_tokens', 1000),
    ('tiktoken_special_tokens', None),
    ('adlr_autoresume', False),
    ('adlr_autoresume_interval', 1000),
    ('ict_head_size', None),
    ('biencoder_projection_dim', 0),
    ('biencoder_shared_query_context_model', False),
    ('ict_load', None),
    ('bert_load', None),
    ('titles_data_path', None),
    ('query_in_block_prob', 0.1),
    ('use_one_sent_docs', False),
    ('evidence_data_path', None),
    ('retriever_report_topk_accuracies', []),
    ('retriever_score_scaling', False),
    ('block_data_path', None),
    ('embedding_path', None),
    ('indexer_batch_size', 128),
    ('indexer_log_interval', 1000),
    ('num_classes', 1000),
    ('img_h', 224),
    ('img_w', 224),
    ('num_channels', 3),
    ('patch_dim', 16),
    ('classes_fraction', 1.0),
    ('data_per_class_fraction', 1.0),
    ('data_sharding', True),
    ('head_lr_mult', 1.0),
    ('vision_pretraining', False),
    ('vision_pretraining_type', 'classify'),
    ('vision_backbone_type', 'vit'),
    ('swin_backbone_type', 'tiny'),
    ('mask_type', 'random'),
    ('mask_factor', 1.0),
    ('iter_per_epoch', 1250),
    ('dino_local_img_size', 96),
    ('dino_local_crops_number', 10),
    ('dino_head_hidden_size', 2048),
    ('dino_bottleneck_size', 256),
    ('dino_freeze_last_layer', 1),
    ('dino_norm_last_layer', False),
    ('dino_warmup_teacher_temp', 0.04),
    ('dino_teacher_temp', 0.07),
    ('dino_warmup_teacher_temp_epochs', 30),
    ('qk_layernorm', False),
    ('qk_l2_norm', False),
    ('expert_model_parallel_size', 1),
    ('expert_tensor_parallel_size', 1),
    ('num_experts', None),
    ('moe_layer_freq', 1),
    ('moe_ffn_hidden_size', None),
    ('moe_shared_expert_intermediate_size', None),
    ('moe_shared_expert_overlap', False),
    ('moe_grouped_gemm', False),
    ('moe_use_legacy_grouped_gemm', False),
    ('moe_layer_recompute', False),
    ('moe_extended_tp', False),
    ('moe_use_upcycling', False),
    ('moe_router_load_balancing_type', 'aux_loss'),
    ('moe_router_dtype', None),
    ('moe_router_score_function', 'softmax'),
    ('moe_router_topk', 2),
    ('moe_router_pre_softmax', False),
    ('moe_router_num_groups', None),
    ('moe_router_group_topk', None),
    ('moe_router_topk_scaling_factor', None),
    ('moe_router_enable_expert_bias', False),
    ('moe_router_bias_update_rate', 0.001),
    ('moe_router_force_load_balancing', False),
    ('moe_router_padding_for_fp8', False),
    ('moe_aux_loss_coeff', 0.0),
    ('moe_z_loss_coeff', None),
    ('moe_input_jitter_eps', None),
    ('moe_per_layer_logging', False),
    ('moe_token_dispatcher_type', 'allgather'),
    ('moe_enable_deepep', False),
    ('moe_deepep_num_sms', 20),
    ('moe_permute_fusion', False),
    ('moe_expert_capacity_factor', None),
    ('moe_pad_expert_input_to_capacity', False),
    ('moe_token_drop_policy', 'probs'),
    ('moe_apply_probs_on_input', False),
    ('delay_wgrad_compute', False),
    ('moe_upcycling_granularity', 1),
    ('q_lora_rank', None),
    ('kv_lora_rank', 32),
    ('qk_head_dim', 128),
    ('qk_pos_emb_head_dim', 64),
    ('v_head_dim', 128),
    ('rotary_scaling_factor', 1.0),
    ('mscale', 1.0),
    ('mscale_all_dim', 1.0),
    ('heterogeneous_layers_config_path', None),
    ('heterogeneous_layers_config_encoded_json', None),
    ('log_params_norm', False),
    ('log_num_zeros_in_grad', False),
    ('log_throughput', False),
    ('log_progress', False),
    ('timing_log_level', 0),
    ('log_energy', False),
    ('barrier_with_L1_time', True),
    ('timing_log_option', 'minmax'),
    ('tensorboard_log_interval', 1),
    ('tensorboard_queue_size', 1000),
    ('log_timers_to_tensorboard', False),
    ('log_loss_scale_to_tensorboard', True),
    ('log_validation_ppl_to_tensorboard', False),
    ('log_memory_to_tensorboard', False),
    ('log_world_size_to_tensorboard', False),
    ('wandb_project', ''),
    ('wandb_exp_name', ''),
    ('wandb_save_dir', ''),
    ('logging_level', None),
    ('log_straggler', False),
    ('disable_straggler_on_startup', False),
    ('straggler_ctrlr_port', 65535),
    ('straggler_minmax_count', 1),
    ('run_workload_inspector_server', False),
    ('inference_batch_times_seqlen_threshold', -1),
    ('max_tokens_to_oom', 12000),
    ('output_bert_embeddings', False),
    ('bert_embedder_type', 'megatron'),
    ('flash_decode', False),
    ('enable_cuda_graph', False),
    ('cuda_graph_warmup_steps', 3),
    ('external_cuda_graph', False),
    ('cuda_graph_scope', 'full'),
    ('inference_max_batch_size', 8),
    ('inference_max_seq_length', 2560),
    ('inference_dynamic_batching', False),
    ('inference_dynamic_batching_buffer_size_gb', 40.0),
    ('inference_dynamic_batching_chunk_size', 256),
    ('inference_dynamic_batching_buffer_guaranteed_fraction', 0.2),
    ('inference_dynamic_batching_buffer_overflow_factor', None),
    ('inference_dynamic_batching_max_requests_override', None),
    ('inference_dynamic_batching_max_tokens_override', None),
    ('symmetric_ar_type', None),
    ('nccl_all_reduce_for_prefill', False),
    ('mlp_chunks_for_prefill', 1),
    ('fp8', None),
    ('fp8_recipe', 'delayed'),
    ('fp8_margin', 0),
    ('fp8_interval', 1),
    ('fp8_amax_history_len', 1),
    ('fp8_amax_compute_algo', 'most_recent'),
    ('fp8_wgrad', True),
    ('transformer_impl', 'transformer_engine'),
    ('fp8_param_gather', False),
    ('first_last_layers_bf16', False),
    ('num_layers_at_start_in_bf16', 1),
    ('num_layers_at_end_in_bf16', 1),
    ('te_rng_tracker', False),
    ('inference_rng_tracker', False),
    ('retro_project_dir', None),
    ('retro_add_retriever', False),
    ('retro_cyclic_train_iters', None),
    ('retro_encoder_layers', 2),
    ('retro_encoder_hidden_dropout', 0.1),
    ('retro_encoder_attention_dropout', 0.1),
    ('retro_num_neighbors', 2),
    ('retro_num_retrieved_chunks', 2),
    ('retro_attention_gate', 1),
    ('retro_verify_neighbor_count', True),
    ('enable_experimental', False),
    ('spec', None),
    ('hybrid_attention_ratio', 0.0),
    ('hybrid_mlp_ratio', 0.0),
    ('hybrid_override_pattern', None),
    ('mamba_state_dim', 128),
    ('mamba_head_dim', 64),
    ('mamba_num_groups', 8),
    ('mamba_num_heads', None),
    ('is_hybrid_model', False),
    ('disable_mamba_mem_eff_path', False),
    ('yaml_cfg', None),
    ('use_precision_aware_optimizer', False),
    ('main_grads_dtype', ('__torch_dtype__', 'float32')),
    ('main_params_dtype', ('__torch_dtype__', 'float32')),
    ('exp_avg_dtype', ('__torch_dtype__', 'float32')),
    ('exp_avg_sq_dtype', ('__torch_dtype__', 'float32')),
    ('enable_one_logger', True),
    ('one_logger_project', 'megatron-lm'),
    ('one_logger_run_name', None),
    ('one_logger_async', False),
    ('app_tag_run_name', None),
    ('app_tag_run_version', '0.0.0'),
    ('inprocess_restart', False),
    ('inprocess_max_iterations', None),
    ('inprocess_monitor_thread_interval', 1.0),
    ('inprocess_monitor_process_interval', 1.0),
    ('inprocess_progress_watchdog_interval', 1.0),
    ('inprocess_heartbeat_interval', 30),
    ('inprocess_soft_timeout', 60),
    ('inprocess_hard_timeout', 90),
    ('inprocess_heartbeat_timeout', 60),
    ('inprocess_barrier_timeout', 120),
    ('inprocess_completion_timeout', 120),
    ('inprocess_last_call_wait', 1),
    ('inprocess_termination_grace_time', 1),
    ('inprocess_granularity', 'node'),
    ('inprocess_active_world_size', 1),
    ('inprocess_empty_cuda_cache', False),
    ('enable_ft_package', False),
    ('calc_ft_timeouts', False),
    ('config_logger_dir', ''),
    ('error_injection_rate', 0),
    ('error_injection_type', 'transient_error'),
    ('rerun_mode', 'disabled'),
    ('enable_msc', True),
    ('sft', False),
    ('sft_tokenizer_prompt_format', 'nemotron-h-aligned'),
    ('rank', 0),
    ('world_size', 1),
    ('use_dist_ckpt', False),
    ('transformer_pipeline_model_parallel_size', 1),
    ('data_parallel_size', 1),
    ('virtual_pipeline_model_parallel_size', None),
    ('params_dtype', ('__torch_dtype__', 'bfloat16')),
    ('consumed_train_samples', 0),
    ('skipped_train_samples', 0),
    ('consumed_valid_samples', 0),
    ('variable_seq_lengths', False),
]
