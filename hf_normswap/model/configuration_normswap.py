"""NormSwap configuration: layer-norm placement, norm type and position scheme as fields."""

import math
import re

import transformers


TRANSFORMERS_REQUIREMENT = "transformers>=5.5.0,<6"  # as pyproject.toml declares


def check_transformers_release(version: str = transformers.__version__) -> None:
    """Refuses, in one line, a Transformers release outside `TRANSFORMERS_REQUIREMENT`."""
    low, high = (tuple(map(int, bound.split("."))) for bound in re.findall(r"\d[\d.]*", TRANSFORMERS_REQUIREMENT))
    if not low <= tuple(int(part) for part in re.findall(r"\d+", version)[:3]) < high:
        raise ImportError(f"NormSwap needs {TRANSFORMERS_REQUIREMENT}, found {version}: pip install it in that range")


check_transformers_release()

from huggingface_hub.dataclasses import strict  # noqa: E402 (after the release check: 4.x lacks these names)
from transformers import PreTrainedConfig  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters  # noqa: E402


# Which of the three norm slots around a residual sublayer F a placement fills:
#     x -> residual_norm(omega * x + output_norm(F(input_norm(x) * s)))
# omega is 1, DeepNorm's constant alpha or Admin's learned vector; s is 1, or 1/sqrt(depth) for LayerNorm Scaling.
# "none" fills no slot: a norm-free stream, x -> x + F(x).
NORM_PLACEMENTS = {
    "post": {"residual_norm"},
    "pre": {"input_norm"},
    "sandwich": {"input_norm", "output_norm"},
    "pre_post": {"input_norm", "residual_norm"},
    "deepnorm": {"residual_norm"},
    "output": {"output_norm"},
    "lns": {"input_norm"},
    "admin": {"residual_norm"},
    "none": set(),
}
INITIALIZERS = ("normal", "xavier")
NORM_TYPES = ("layernorm", "rmsnorm", "dyt")
POSITION_EMBEDDING_TYPES = ("absolute", "sinusoidal", "rope", "alibi", "none")
MLP_TYPES = ("standard", "glu")
QK_NORM_SCOPES = ("head", "projection")
CLASSIFIER_POOLINGS = ("cls", "mean", "last")
ROPE_TYPES = ("default", *ROPE_INIT_FUNCTIONS)
LAYER_TYPES = ("full_attention", "sliding_attention")


def rope_parameters_by_layer_type(rope_parameters) -> bool:
    """Whether `rope_parameters` holds one dict per layer type (Gemma 3, ModernBERT) rather than one for all layers."""
    return bool(rope_parameters) and set(rope_parameters) <= set(LAYER_TYPES)


def mix_ln_placement(num_hidden_layers: int, post_fraction: float = 0.25) -> list[str]:
    """Mix-LN (Li et al. 2024): post-LN in the first `post_fraction` of the layers, pre-LN in the rest."""
    if not 0.0 <= post_fraction <= 1.0:
        raise ValueError(f"post_fraction must be between 0 and 1, got {post_fraction!r}.")
    num_post = int(post_fraction * num_hidden_layers)
    return ["post"] * num_post + ["pre"] * (num_hidden_layers - num_post)


def _allowed(names) -> str:
    return f"allowed are {', '.join(names)}"


def _require(condition: bool, field: str, value, allowed: str) -> None:
    if not condition:
        raise ValueError(f"NormSwapConfig.{field}={value!r} is invalid: {allowed}.")


def _check_rows(config, rows) -> None:
    """Checks `(field, test, allowed)` rows in order: `test(value, config)` must hold, or the error says `allowed`,
    formatted with the config (`{config.vocab_size}`)."""
    for field, test, allowed in rows:
        value = getattr(config, field)
        _require(test(value, config), field, value, allowed.format(config=config))


_POSITIVE_INTEGER = "must be a positive integer"
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_SIZE_CHECKS = (
    *((field, lambda value, config: value >= 1, _POSITIVE_INTEGER) for field in (*_SIZES, "embedding_size")),
    ("head_dim", lambda value, config: value >= 1, _POSITIVE_INTEGER),
    (
        "num_key_value_heads",
        lambda value, config: value >= 1 and config.num_attention_heads % value == 0,
        "must be a positive divisor of num_attention_heads ({config.num_attention_heads})",
    ),
)
_NORM_AND_POSITION_CHECKS = (
    (
        "first_attention_input_norm",
        lambda value, config: value or "input_norm" in NORM_PLACEMENTS[config.layer_norm_placements[0]],
        "False leaves out the first layer's attention input norm, which its placement "
        "{config.layer_norm_placements[0]!r} does not have",
    ),
    (
        "first_position_scales",
        lambda value, config: value is None or len(value) == 2 * config.num_hidden_layers + 1,
        "one per sublayer and one before the head ({config.num_hidden_layers} layers), or None",
    ),  # fmt: skip
    ("norm_type", lambda value, config: value in NORM_TYPES, _allowed(NORM_TYPES)),
    ("norm_eps", lambda value, config: value > 0, "must be positive"),
    ("dyt_alpha_init", lambda value, config: value > 0, "must be positive"),
    (
        "position_embedding_type",
        lambda value, config: value in POSITION_EMBEDDING_TYPES,
        _allowed(POSITION_EMBEDDING_TYPES),
    ),
    ("max_position_embeddings", lambda value, config: value >= 1, _POSITIVE_INTEGER),
    ("position_offset", lambda value, config: value >= 0, "must be 0 or more"),
    (
        "position_offset",
        lambda value, config: config.position_embedding_type != "absolute" or value < config.max_position_embeddings,
        "absolute positions must start inside the table of {config.max_position_embeddings}",
    ),
    (
        "head_dim",
        lambda value, config: config.position_embedding_type != "rope" or value % 2 == 0,
        "rope needs an even head_dim",
    ),
)
_MODULE_CHECKS = (
    ("qk_norm_scope", lambda value, config: value in QK_NORM_SCOPES, _allowed(QK_NORM_SCOPES)),
    *(
        (field, lambda value, config: value is None or value > 0, "must be None or positive")
        for field in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
    ),
    ("embedding_multiplier", lambda value, config: value > 0, "must be positive"),
    ("type_vocab_size", lambda value, config: value >= 0, "must be 0 (none) or more"),
    ("hidden_act", lambda value, config: value in ACT2FN, _allowed(sorted(ACT2FN))),
    ("mlp_type", lambda value, config: value in MLP_TYPES, _allowed(MLP_TYPES)),
    ("classifier_pooling", lambda value, config: value in CLASSIFIER_POOLINGS, _allowed(CLASSIFIER_POOLINGS)),
    (
        "classifier_activation",
        lambda value, config: value is None or value in ACT2FN,
        _allowed(["None (no dense layer)", *sorted(ACT2FN)]),
    ),
    *(
        (
            field,
            lambda value, config: not value or config.classifier_activation is not None,
            "needs the classifier head's dense layer (classifier_activation, None here)",
        )
        for field in ("classifier_norm", "token_classifier_head")
    ),
    *(
        (field, lambda value, config: value is None or 0 <= value < 1, "must be in [0, 1)")
        for field in ("attention_dropout", "hidden_dropout", "classifier_dropout")
    ),
    ("initializer_range", lambda value, config: value >= 0, "must be 0 or more"),
    ("initializer", lambda value, config: value in INITIALIZERS, _allowed(INITIALIZERS)),
    (
        "pad_token_id",
        lambda value, config: value is None or 0 <= value < config.vocab_size,
        "must be None or a token id below vocab_size ({config.vocab_size})",
    ),
    ("is_decoder", lambda value, config: not value, "cross-attention is not supported; use is_causal"),
)


@strict
class NormSwapConfig(PreTrainedConfig):
    r"""
    Configuration of a [`NormSwapModel`]: a Transformer (an encoder, or a causal LM with `is_causal`) whose layer-norm
    placement, norm type and position scheme are fields. The defaults give a BERT-base shaped post-LN encoder.

    norm_placement (`str` or `list[str]`, defaults to `"post"`):
        Where the norms sit around each residual sublayer F, for all layers or one value per layer (Mix-LN, see
        [`mix_ln_placement`]). `"post"`: x = N(x + F(x)); `"pre"`: x = x + F(N(x)); `"sandwich"`:
        x = x + N(F(N(x))); `"pre_post"`: x = N(x + F(N(x))); `"deepnorm"`: x = N(a*x + F(x)) with a = (2L)^(1/4);
        `"output"`: x = x + N(F(x)); `"lns"` (LayerNorm Scaling, Sun et al. 2025): x = x + F(N(x) / sqrt(l)) in the
        layer at depth l = 1, 2, ...; `"admin"` (Liu et al. 2020): x = N(w * x + F(x)), w a learned per-feature vector
        (1 at initialisation; see [`profile_admin`] for its profiled start); `"none"`: x = x + F(x) (norm-free).
    norm_type (`str`, defaults to `"layernorm"`): `"layernorm"` (biased if `norm_bias`), `"rmsnorm"` or `"dyt"`.
    initializer (`str`, defaults to `"normal"`):
        How fresh attention and feed-forward weights start: `"normal"` (std `initializer_range`, as BERT) or
        `"xavier"` (Xavier-normal, as Vaswani et al., Xiong et al., Liu et al. and Wang et al.); DeepNorm multiplies
        the value, output and feed-forward weights by beta = (8L)^(-1/4) under both. Embeddings and heads stay normal.
    embedding_norm / final_norm (`bool`, *optional*):
        Norm after the embeddings / after the last layer. Default: an embedding norm when the first layer normalizes
        the residual stream after the sum (post, pre_post, deepnorm, admin) or when the embeddings are projected, a
        final norm when the last layer leaves it un-normalized (pre, sandwich, output, lns); none with `"none"`.
    final_scale (`bool`, *optional*):
        A fixed per-feature scale (LayerNorm models: centring and shift too), no norm, in place of the final norm.
        Default: when the last layer's placement is `"none"`. `removed_norm_rms` records what the norms a norm-free
        conversion removed divided by (a gradual removal reads it): the source's median stream RMS at each, in forward
        order; `first_position_scales` multiply each sequence's first position there (its own divisor: r / r at
        position 0).
    first_attention_input_norm (`bool`, defaults to `True`):
        Whether the first layer's attention has its input norm (ModernBERT's has not: its embedding norm's output).
    embedding_size (`int`, *optional*):
        Width of the token, token-type and position embeddings (and of the masked-LM head's decoder), projected to
        `hidden_size` after the embedding norm when different, as ELECTRA's. Default: `hidden_size`.
    position_embedding_type (`str`, defaults to `"absolute"`) / position_offset (`int`, defaults to 0):
        `"absolute"` (learned table), `"sinusoidal"`, `"rope"` (see `rope_parameters`), `"alibi"` or `"none"` / added
        to the position ids of absolute and sinusoidal embeddings (RoBERTa starts after its padding index).
    rope_parameters (`dict`, *optional*):
        Transformers' rope parameters: one dict for all layers, or one per layer type (`{"full_attention": {...},
        "sliding_attention": {...}}`, as Gemma 3 and ModernBERT). Only RoPE models keep them (defaults filled in);
        with another `position_embedding_type` they are checked, then dropped (None), not to look like RoPE.
    is_causal (`bool`, defaults to `False`):
        Causal attention instead of bidirectional. `use_cache`: whether a causal model's forward returns its key/value
        cache (`cache`) when the call does not say.
    layer_types (`list[str]`, *optional*) / sliding_window (`int`, *optional*):
        One per layer, `"full_attention"` or `"sliding_attention"` (None: all full) / the sliding window, as masks
        read it: causally a token sees itself and the `sliding_window - 1` tokens before it (Mistral, Gemma 2);
        bidirectionally every token at most `sliding_window` positions away (ModernBERT's `local_attention // 2`).
    qk_norm (`bool`, defaults to `False`) / qk_norm_scope (`str`, defaults to `"head"`):
        A norm of `norm_type` on queries and keys, before rope, of each head (Qwen3, Gemma 3) or the whole projection
        (`"projection"`, OLMo 2).
    query_pre_attn_scalar, attn_logit_softcapping, final_logit_softcapping, embedding_multiplier (Gemma's):
        Scores scaled by `query_pre_attn_scalar ** -0.5` instead of `head_dim ** -0.5`; soft-capping c * tanh(x / c) of
        the attention scores (eager, flash, flex) and the causal LM's logits; token embeddings times a multiplier.
    mlp_type (`str`, defaults to `"standard"`): `"standard"` (up, act, down) or `"glu"` (down(act(gate(x)) * up(x))).
    classifier_pooling (`str`, defaults to `"cls"`): `"cls"` (the first token), `"mean"` or `"last"` (last real token).
    classifier_activation (`str`, *optional*):
        Activation of the dense layer between pooling and classifier; `None` for no dense layer. Default: `"tanh"`
        with `"cls"` pooling (BERT's pooler), none with `"mean"` and `"last"`.
    classifier_norm / token_classifier_head (`bool`, defaults to `False`):
        A norm after that activation (ModernBERT's head: dense, activation, norm) / token classification and
        question answering pass every token through that head before the classifier, as ModernBERT does.
    head_dense_bias / decoder_bias (`bool`, defaults to `True`):
        Bias of the dense layer of the masked-LM and classifier heads (ModernBERT's `classifier_bias`) / of the
        masked-LM decoder.
    """

    model_type = "normswap"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    default_theta = 10_000.0

    vocab_size: int = 30522
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    initializer: str = "normal"

    norm_placement: str | list[str] = "post"
    norm_type: str = "layernorm"
    norm_eps: float = 1e-12
    norm_bias: bool = True
    dyt_alpha_init: float = 0.5
    embedding_norm: bool | None = None
    final_norm: bool | None = None
    final_scale: bool | None = None
    removed_norm_rms: list[float] | None = None
    first_position_scales: list[float] | None = None
    first_attention_input_norm: bool = True
    embedding_size: int | None = None

    position_embedding_type: str = "absolute"
    position_offset: int = 0
    rope_parameters: RopeParameters | dict | None = None

    is_causal: bool = False
    use_cache: bool = True
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    attention_bias: bool = True
    attention_output_bias: bool | None = None
    qk_norm: bool = False
    qk_norm_scope: str = "head"
    query_pre_attn_scalar: float | int | None = None
    attn_logit_softcapping: float | int | None = None
    final_logit_softcapping: float | int | None = None
    embedding_multiplier: float | int = 1.0
    attention_dropout: float | int = 0.0
    hidden_dropout: float | int = 0.1

    mlp_type: str = "standard"
    mlp_bias: bool = True

    classifier_pooling: str = "cls"
    classifier_activation: str | None = None
    classifier_norm: bool = False
    token_classifier_head: bool = False
    classifier_bias: bool = True
    classifier_dropout: float | int | None = None
    head_dense_bias: bool = True
    decoder_bias: bool = True

    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = True
    is_decoder: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads > 0:
            _require(
                self.hidden_size % self.num_attention_heads == 0,
                "hidden_size",
                self.hidden_size,
                f"must be a multiple of num_attention_heads ({self.num_attention_heads}) unless head_dim is set",
            )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_output_bias is None:
            self.attention_output_bias = self.attention_bias
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.embedding_size is None:
            self.embedding_size = self.hidden_size
        if self.classifier_activation is None and self.classifier_pooling == "cls":
            self.classifier_activation = "tanh"
        self._check_fields()
        placements = self.layer_norm_placements
        if self.embedding_norm is None:
            projected = self.embedding_size != self.hidden_size
            self.embedding_norm = projected or "residual_norm" in NORM_PLACEMENTS[placements[0]]
        last = NORM_PLACEMENTS[placements[-1]]
        if self.final_norm is None:
            self.final_norm = bool(last) and "residual_norm" not in last and not self.final_scale
        if self.final_scale is None:
            self.final_scale = not last and not self.final_norm
        _require(not (self.final_scale and self.final_norm), "final_scale", True, "it replaces the final norm")
        super().__post_init__(**kwargs)
        self._check_rope()
        if self.position_embedding_type != "rope":  # checked, but nothing reads them
            self.rope_parameters = None
        self.base_model_tp_plan = self._tensor_parallel_plan()  # set after the base's: 5.15 to 5.20 assign it there

    @property
    def layer_norm_placements(self) -> list[str]:
        """The placement of every layer."""
        if isinstance(self.norm_placement, str):
            return [self.norm_placement] * self.num_hidden_layers
        return list(self.norm_placement)

    def _tensor_parallel_plan(self) -> dict[str, str]:
        """`base_model_tp_plan`, LLaMA's split; projections gather their outputs where attention must see every head
        (ALiBi, q/k norms over the projection: OLMo 2's), q/k norms per head gather their gradients (Qwen 3's)."""
        heads_split = self.position_embedding_type != "alibi" and not (self.qk_norm and self.qk_norm_scope != "head")
        attention = ("colwise", "rowwise") if heads_split else ("colwise_gather_output", "rowwise_split_input")
        plan = {"embeddings.word_embeddings": "embedding_rowwise"}
        plan.update({f"layers.*.self_attn.{name}_proj": attention[0] for name in ("q", "k", "v")})
        plan["layers.*.self_attn.o_proj"] = attention[1]
        if self.qk_norm and heads_split:
            plan.update({f"layers.*.self_attn.{name}_norm": "replicated_with_grad_allreduce" for name in ("q", "k")})
        if self.mlp_type == "glu":
            plan["layers.*.mlp.gate_proj"] = "colwise"
        plan.update({"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"})
        return plan

    @property
    def deepnorm_alpha(self) -> float:  # DeepNet's residual scale for an encoder of L layers: (2L)^(1/4)
        return (2 * self.num_hidden_layers) ** 0.25

    @property
    def deepnorm_beta(self) -> float:  # DeepNet's init scale of value, output and feed-forward weights: (8L)^(-1/4)
        return (8 * self.num_hidden_layers) ** -0.25

    def _check_fields(self) -> None:
        _check_rows(self, _SIZE_CHECKS)
        self._check_norm_placement()
        _check_rows(self, _NORM_AND_POSITION_CHECKS)
        self._check_attention_types()
        _check_rows(self, _MODULE_CHECKS)

    def _check_norm_placement(self) -> None:
        allowed = _allowed(NORM_PLACEMENTS)
        if isinstance(self.norm_placement, str):
            _require(self.norm_placement in NORM_PLACEMENTS, "norm_placement", self.norm_placement, allowed)
            return
        _require(
            len(self.norm_placement) == self.num_hidden_layers,
            "norm_placement",
            self.norm_placement,
            f"a per-layer list needs one value for each of the {self.num_hidden_layers} layers",
        )
        for placement in self.norm_placement:
            _require(placement in NORM_PLACEMENTS, "norm_placement", placement, allowed)

    def _check_attention_types(self) -> None:
        _require(
            isinstance(self.layer_types, list | tuple) and len(self.layer_types) == self.num_hidden_layers,
            "layer_types",
            self.layer_types,
            f"needs one value for each of the {self.num_hidden_layers} layers",
        )
        for layer_type in self.layer_types:
            _require(layer_type in LAYER_TYPES, "layer_types", layer_type, _allowed(LAYER_TYPES))
        _require(
            self.sliding_window is None or self.sliding_window >= 1,
            "sliding_window",
            self.sliding_window,
            "must be None or a positive integer",
        )
        _require(
            self.sliding_window is not None or "sliding_attention" not in self.layer_types,
            "sliding_window",
            self.sliding_window,
            "'sliding_attention' layers need a window",
        )
        if rope_parameters_by_layer_type(self.rope_parameters):
            _require(
                set(self.rope_parameters) == set(self.layer_types),
                "rope_parameters",
                self.rope_parameters,
                "a dict per layer type needs one entry for each type in layer_types "
                f"({sorted(set(self.layer_types))})",
            )

    def convert_rope_params_to_dict(self, **kwargs):
        """Fills `rope_type` and `rope_theta` in the rope dict, or in each layer type's (the same in every release)."""
        rope_theta = kwargs.pop("rope_theta", self.default_theta)
        self.rope_parameters = kwargs.pop("rope_scaling", None) or self.rope_parameters or {}
        nested = rope_parameters_by_layer_type(self.rope_parameters)
        for parameters in self.rope_parameters.values() if nested else [self.rope_parameters]:
            _require(
                isinstance(parameters, dict), "rope_parameters", self.rope_parameters, "each entry must be a dict"
            )
            parameters.setdefault("rope_type", parameters.get("type", "default"))
            parameters.setdefault("rope_theta", rope_theta)
        self.standardize_rope_params()
        return kwargs

    @property
    def layer_rope_parameters(self) -> dict[str, dict]:
        """The rope parameters of each layer type in use (empty dicts without RoPE)."""
        if rope_parameters_by_layer_type(self.rope_parameters):
            return dict(self.rope_parameters)
        return {layer_type: dict(self.rope_parameters or {}) for layer_type in self.layer_types}

    def _check_rope(self) -> None:
        for parameters in self.layer_rope_parameters.values():
            rope_type = parameters.get("rope_type", "default")
            _require(
                rope_type in ROPE_TYPES, "rope_parameters", self.rope_parameters, f"rope_type must be in {ROPE_TYPES}"
            )
            factor = parameters.get("partial_rotary_factor", 1.0)
            _require(
                math.isclose(factor, 1.0), "rope_parameters", self.rope_parameters, "partial_rotary_factor must be 1"
            )


NormSwapConfig.register_for_auto_class()

__all__ = ["NormSwapConfig", "mix_ln_placement", "NORM_PLACEMENTS", "LAYER_TYPES", "INITIALIZERS"]
