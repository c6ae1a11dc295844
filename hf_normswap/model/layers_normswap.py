"""The building blocks of NormSwap: embeddings, attention, feed-forward, the layer, and the heads' layers."""

from collections.abc import Callable

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .configuration_normswap import NormSwapConfig
from .norms_normswap import ResidualNorms, build_norm
from .positions_normswap import alibi_attention_mask, apply_rotary_pos_emb, sinusoidal_position_embeddings


class NormSwapEmbeddings(nn.Module):
    """Token embeddings, plus token-type and absolute or sinusoidal position embeddings where configured, projected
    to `hidden_size` after the norm when `embedding_size` differs (ELECTRA)."""

    def __init__(self, config: NormSwapConfig):
        super().__init__()
        self.position_embedding_type = config.position_embedding_type
        self.position_offset = config.position_offset
        size = config.embedding_size
        self.word_embeddings = nn.Embedding(config.vocab_size, size, padding_idx=config.pad_token_id)
        self.embedding_multiplier = config.embedding_multiplier
        if config.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(config.type_vocab_size, size)
        if config.position_embedding_type == "absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, size)
        self.norm = build_norm(config, size=size) if config.embedding_norm else nn.Identity()
        self.dropout = nn.Dropout(config.hidden_dropout)
        if size != config.hidden_size:
            self.projection = nn.Linear(size, config.hidden_size)

    def forward(
        self,
        input_ids: torch.LongTensor | None,
        inputs_embeds: torch.Tensor | None,
        token_type_ids: torch.LongTensor | None,
        position_ids: torch.LongTensor,
    ) -> torch.Tensor:
        embeddings = inputs_embeds
        if inputs_embeds is None:
            embeddings = self.word_embeddings(input_ids)
            if self.embedding_multiplier != 1.0:
                embeddings = embeddings * torch.tensor(self.embedding_multiplier, dtype=embeddings.dtype)
        if hasattr(self, "token_type_embeddings"):
            if token_type_ids is None:
                token_type_ids = torch.zeros(embeddings.shape[:-1], dtype=torch.long, device=embeddings.device)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.position_embedding_type == "absolute":
            embeddings = embeddings + self.position_embeddings(position_ids + self.position_offset)
        elif self.position_embedding_type == "sinusoidal":
            table = sinusoidal_position_embeddings(
                position_ids=position_ids + self.position_offset, dim=embeddings.shape[-1]
            )
            embeddings = embeddings + table.to(embeddings.dtype)
        embeddings = self.dropout(self.norm(embeddings))
        return self.projection(embeddings) if hasattr(self, "projection") else embeddings


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, kv_heads, seq, dim) -> (batch, kv_heads * n_rep, seq, dim)."""
    if n_rep == 1:
        return hidden_states
    return hidden_states.repeat_interleave(n_rep, dim=1)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Unpack[TransformersKwargs],
):
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        attn_weights = torch.tanh(attn_weights / softcap) * softcap
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class NormSwapAttention(nn.Module):
    """Multi-head attention with GQA, optional q/k norms (per head or over the projection), rotary embeddings or ALiBi,
    a sliding window where the layer type says so, and a KV cache."""

    def __init__(self, config: NormSwapConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.attention_type = config.layer_types[layer_idx]
        # the window in flash attention's terms (the masks carry it for the other implementations)
        self.sliding_window = None
        if self.attention_type == "sliding_attention":
            self.sliding_window = config.sliding_window + (0 if config.is_causal else 1)
        self.alibi = config.position_embedding_type == "alibi"
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = config.is_causal
        q_size, kv_size = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_output_bias)
        self.qk_norm_per_head = config.qk_norm_scope == "head"
        q_norm_size, k_norm_size = (self.head_dim, self.head_dim) if self.qk_norm_per_head else (q_size, kv_size)
        self.q_norm = build_norm(config, size=q_norm_size) if config.qk_norm else nn.Identity()
        self.k_norm = build_norm(config, size=k_norm_size) if config.qk_norm else nn.Identity()

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states, key_states = self.q_proj(hidden_states), self.k_proj(hidden_states)
        if self.qk_norm_per_head:
            query_states, key_states = query_states.view(hidden_shape), key_states.view(hidden_shape)
        query_states = self.q_norm(query_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_norm(key_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(q=query_states, k=key_states, cos=cos, sin=sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
        if self.alibi:
            attention_mask = alibi_attention_mask(
                attention_mask=attention_mask,
                num_heads=self.config.num_attention_heads,
                query_length=query_states.shape[-2],
                key_length=key_states.shape[-2],
                is_causal=self.is_causal,
                dtype=query_states.dtype,
                device=query_states.device,
            )

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            softcap=self.config.attn_logit_softcapping,
            **kwargs,
        )
        attn_output = self.o_proj(attn_output.reshape(*input_shape, -1).contiguous())
        return attn_output, attn_weights


class NormSwapMLP(nn.Module):
    """up -> activation -> down (BERT's feed-forward)."""

    def __init__(self, config: NormSwapConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(hidden_states)))


class NormSwapGatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu."""

    def __init__(self, config: NormSwapConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


MLP_CLASSES = {"standard": NormSwapMLP, "glu": NormSwapGatedMLP}


class NormSwapLayer(GradientCheckpointingLayer):
    """Attention then feed-forward, each wrapped in the norms of this layer's placement."""

    def __init__(self, config: NormSwapConfig, layer_idx: int):
        super().__init__()
        placement = config.layer_norm_placements[layer_idx]
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = NormSwapAttention(config, layer_idx)
        attention_input_norm = layer_idx > 0 or config.first_attention_input_norm
        depth = layer_idx + 1
        self.attention_norms = ResidualNorms(
            config, placement, depth=depth, point=2 * layer_idx, input_norm=attention_input_norm
        )
        self.mlp = MLP_CLASSES[config.mlp_type](config)
        self.mlp_norms = ResidualNorms(config, placement, depth=depth, point=2 * layer_idx + 1)
        beta = config.deepnorm_beta if placement == "deepnorm" else 1.0
        attention = self.self_attn
        for linear in (attention.q_proj, attention.k_proj):
            linear.init_gain = 1.0
        mlp_linears = [module for module in self.mlp.children() if isinstance(module, nn.Linear)]
        for linear in (attention.v_proj, attention.o_proj, *mlp_linears):
            linear.init_gain = beta

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        first_positions: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        attn_input = self.attention_norms.normalize_input(hidden_states, first_positions)
        attn_output, _ = self.self_attn(
            attn_input,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            cache=cache,
            **kwargs,
        )
        hidden_states = self.attention_norms.add_residual(hidden_states, attn_output)
        mlp_output = self.mlp(self.mlp_norms.normalize_input(hidden_states, first_positions))
        return self.mlp_norms.add_residual(hidden_states, mlp_output)


class NormSwapMaskedLMHead(nn.Module):
    """BERT's masked-LM head: dense (to `embedding_size`), activation, norm, then a decoder tied to the word
    embeddings."""

    def __init__(self, config: NormSwapConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.embedding_size, bias=config.head_dense_bias)
        self.act_fn = ACT2FN[config.hidden_act]
        self.norm = build_norm(config, size=config.embedding_size)
        self.decoder = nn.Linear(config.embedding_size, config.vocab_size, bias=config.decoder_bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act_fn(self.dense(hidden_states))))


class NormSwapClassifierHead(nn.Module):
    """Dense -> `classifier_activation` -> norm (when `classifier_norm`): BERT's pooler is dense + tanh, ModernBERT's
    head dense, gelu and norm; the identity without `classifier_activation`."""

    def __init__(self, config: NormSwapConfig):
        super().__init__()
        if config.classifier_activation is not None:
            self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.head_dense_bias)
            self.act_fn = ACT2FN[config.classifier_activation]
            self.norm = build_norm(config, size=config.hidden_size) if config.classifier_norm else nn.Identity()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "dense"):
            return hidden_states
        return self.norm(self.act_fn(self.dense(hidden_states)))


class NormSwapPooler(NormSwapClassifierHead):
    """Pools a sequence to one vector (`cls`: first token, `mean`, `last`: last non-padding token), then applies the
    classifier head."""

    def __init__(self, config: NormSwapConfig):
        super().__init__(config)
        self.pooling = config.classifier_pooling

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return super().forward(self.pool(hidden_states, attention_mask))

    def pool(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if self.pooling == "cls":
            return hidden_states[:, 0]
        if attention_mask is None:
            attention_mask = torch.ones(hidden_states.shape[:2], device=hidden_states.device)
        mask = attention_mask.to(hidden_states.dtype)
        if self.pooling == "mean":
            return (hidden_states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = (positions * attention_mask.to(torch.long)).argmax(-1)
        return hidden_states[torch.arange(hidden_states.shape[0], device=last.device), last]
