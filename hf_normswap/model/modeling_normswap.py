"""NormSwap: a Transformer (encoder or causal LM) whose norm placement, norm type and positions are config fields."""

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_bidirectional_sliding_window_mask,
    create_causal_mask,
    create_sliding_window_causal_mask,
    packed_sequence_mask_function,
)
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_normswap import NormSwapConfig
from .layers_normswap import (
    NormSwapAttention,
    NormSwapClassifierHead,
    NormSwapEmbeddings,
    NormSwapLayer,
    NormSwapMaskedLMHead,
    NormSwapPooler,
)
from .norms_normswap import NormSwapDyT, NormSwapFixedScale, ResidualNorms, build_norm, scale_first_positions
from .packed_sequences_normswap import (
    flash_varlen_kwargs,
    mask_padding,
    next_token_labels,
    packed_sequence_ids,
    positions_in_sequence,
    unpack_sequences,
)
from .positions_normswap import NormSwapRotaryEmbedding, rotary_by_layer_type


# The key/value cache's name in Transformers' forwards, mask builders and outputs: `past_key_values` before 5.24.
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


class NormSwapPreTrainedModel(PreTrainedModel):
    config: NormSwapConfig
    config_class = NormSwapConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["NormSwapEmbeddings", "NormSwapLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True  # static caches: compiled (fullgraph) forward and generation
    _can_record_outputs = {"hidden_states": NormSwapLayer, "attentions": NormSwapAttention}

    @property
    def _supports_sdpa(self) -> bool:
        """sdpa cannot soft-cap attention scores."""
        return self.config.attn_logit_softcapping is None

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        super()._init_weights(module)
        if isinstance(module, nn.Linear) and hasattr(module, "init_gain"):  # attention and feed-forward weights
            if self.config.initializer == "xavier":
                init.xavier_normal_(module.weight, gain=module.init_gain)
            elif module.init_gain != 1.0:
                init.normal_(module.weight, std=self.config.initializer_range * module.init_gain)
        elif isinstance(module, ResidualNorms) and module.residual_weight is not None:
            init.ones_(module.residual_weight)
        elif isinstance(module, NormSwapRotaryEmbedding):
            module.reset_frequencies()
        elif isinstance(module, NormSwapDyT | NormSwapFixedScale):
            if isinstance(module, NormSwapDyT):
                init.constant_(module.alpha, self.config.dyt_alpha_init)
            init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)

    @property
    def device(self) -> torch.device:
        """Where the model computes: where FSDP2 gathers sharded parameters, which may keep their shards on the CPU."""
        mesh = getattr(next(self.parameters()), "device_mesh", None)  # a DTensor's
        if mesh is None or mesh.device_type == "cpu":
            return super().device
        return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Saves as Transformers does, with an `auto_map` naming every Auto class for remote-code loading."""
        self.config.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, *args, **kwargs)


class NormSwapModel(NormSwapPreTrainedModel):
    def __init__(self, config: NormSwapConfig):
        super().__init__(config)
        self.embeddings = NormSwapEmbeddings(config)
        self.layers = nn.ModuleList([NormSwapLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.Identity()
        if config.final_norm or config.final_scale:
            build = build_norm if config.final_norm else NormSwapFixedScale
            self.norm = build(config, size=config.hidden_size)
        self.rotary_emb = NormSwapRotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if cache is not None and past_key_values is not None:
            raise ValueError("Pass the key/value cache as `cache` or as `past_key_values`, not both.")
        cache = cache if cache is not None else past_key_values  # its name before Transformers 5.24
        if cache is not None and not self.config.is_causal:
            raise ValueError("A key/value cache needs NormSwapConfig.is_causal=True, got False.")
        if use_cache and cache is None and self.config.is_causal:
            cache = DynamicCache(config=self.config)
        inputs = input_ids if inputs_embeds is None else inputs_embeds
        if position_ids is not None:
            position_ids = position_ids.expand(inputs.shape[0], -1)
        sequence_ids = packed_sequence_ids(
            attention_mask=attention_mask, position_ids=position_ids, seq_idx=kwargs.get("seq_idx")
        )
        if position_ids is None:  # restarting at every sequence of a packed batch; after the cached tokens
            if sequence_ids is not None:
                position_ids = positions_in_sequence(sequence_ids)
            else:
                past_seen = cache.get_seq_length() if cache is not None else 0
                position_ids = torch.arange(past_seen, past_seen + inputs.shape[1], device=inputs.device).unsqueeze(0)
        if sequence_ids is not None and "flash" in self.config._attn_implementation and "cu_seq_lens_q" not in kwargs:
            kwargs.update(flash_varlen_kwargs(sequence_ids))

        hidden_states = self.embeddings(
            input_ids=input_ids, inputs_embeds=inputs_embeds, token_type_ids=token_type_ids, position_ids=position_ids
        )
        masks = self._attention_masks(hidden_states, attention_mask, cache, sequence_ids)
        layer_types = self.config.layer_types
        position_embeddings = rotary_by_layer_type(self.rotary_emb, hidden_states, position_ids, layer_types)

        scales = self.config.first_position_scales
        first_positions = position_ids == 0 if scales else None
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                attention_mask=masks[layer.attention_type],
                position_embeddings=position_embeddings[layer.attention_type],
                cache=cache,
                first_positions=first_positions,
                **kwargs,
            )
        if scales:
            hidden_states = scale_first_positions(hidden_states, first_positions, scales[-1])
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), **{CACHE_NAME: cache})

    def _attention_masks(self, inputs_embeds, attention_mask, cache, sequence_ids) -> dict:
        """Each layer type's mask, from Transformers' masking utilities: causal or bidirectional, full or sliding,
        sized to the cache, block-diagonal over a packed batch's sequences. A dict passes through as is."""
        if isinstance(attention_mask, dict):
            return attention_mask
        implementation = self.config._attn_implementation
        if self.config.position_embedding_type == "alibi" and implementation not in ("eager", "sdpa"):
            raise ValueError(
                f"position_embedding_type='alibi' needs attn_implementation 'eager' or 'sdpa', not {implementation!r}"
            )
        mask_kwargs = {"config": self.config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask}
        if sequence_ids is not None:
            mask_kwargs["and_mask_function"] = packed_sequence_mask_function(sequence_ids)
        if self.config.is_causal:
            mask_kwargs[CACHE_NAME] = cache
            builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        else:
            builders = {
                "full_attention": create_bidirectional_mask,
                "sliding_attention": create_bidirectional_sliding_window_mask,
            }
        return {layer_type: builders[layer_type](**mask_kwargs) for layer_type in set(self.config.layer_types)}


class NormSwapForMaskedLM(NormSwapPreTrainedModel):
    _tp_plan = {"lm_head.decoder": "colwise_gather_output"}
    _tied_weights_keys = {"lm_head.decoder.weight": "model.embeddings.word_embeddings.weight"}

    def __init__(self, config: NormSwapConfig):
        super().__init__(config)
        self.model = NormSwapModel(config)
        self.lm_head = NormSwapMaskedLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MaskedLMOutput:
        outputs = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class NormSwapForSequenceClassification(NormSwapPreTrainedModel):
    accepts_loss_kwargs = False  # a mean loss of its own: the Trainer must not rescale it by the process count

    def __init__(self, config: NormSwapConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = NormSwapModel(config)
        self.pooler = NormSwapPooler(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels, bias=config.classifier_bias)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> SequenceClassifierOutput:
        outputs = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        hidden_states = outputs.last_hidden_state
        sequence_ids = packed_sequence_ids(
            attention_mask=attention_mask, position_ids=position_ids, seq_idx=kwargs.get("seq_idx")
        )
        if sequence_ids is not None:  # pool each sequence of a packed batch, in sequence order
            hidden_states, attention_mask = unpack_sequences(packed=hidden_states, sequence_ids=sequence_ids)
        pooled = self.pooler(hidden_states, attention_mask=attention_mask)
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=logits, config=self.config)
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class NormSwapForTokenClassification(NormSwapPreTrainedModel):
    def __init__(self, config: NormSwapConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = NormSwapModel(config)
        self.head = NormSwapClassifierHead(config) if config.token_classifier_head else nn.Identity()
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels, bias=config.classifier_bias)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> TokenClassifierOutput:
        outputs = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits = self.classifier(self.dropout(self.head(outputs.last_hidden_state)))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config, **kwargs)  # per token, over all devices
        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class NormSwapForQuestionAnswering(NormSwapPreTrainedModel):
    accepts_loss_kwargs = False  # a mean loss of its own: the Trainer must not rescale it by the process count

    def __init__(self, config: NormSwapConfig):
        super().__init__(config)
        self.model = NormSwapModel(config)
        self.head = NormSwapClassifierHead(config) if config.token_classifier_head else nn.Identity()
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> QuestionAnsweringModelOutput:
        outputs = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits = self.qa_outputs(self.head(outputs.last_hidden_state))
        sequence_ids = packed_sequence_ids(
            attention_mask=attention_mask, position_ids=position_ids, seq_idx=kwargs.get("seq_idx")
        )
        if sequence_ids is not None:  # one row of logits per sequence of a packed batch, nothing past its end
            logits, attention_mask = unpack_sequences(packed=logits, sequence_ids=sequence_ids)
            logits = mask_padding(logits=logits, attention_mask=attention_mask)
        start_logits, end_logits = (x.squeeze(-1).contiguous() for x in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:  # padding is never an answer
            starts, ends = (
                x.squeeze(-1) for x in mask_padding(logits=logits, attention_mask=attention_mask).split(1, dim=-1)
            )
            loss = self.loss_function(starts, ends, start_positions, end_positions, **kwargs)
        return QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class NormSwapForCausalLM(NormSwapPreTrainedModel, GenerationMixin):
    """A causal LM head (no bias): scores text and generates with Transformers' caches."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.word_embeddings.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: NormSwapConfig):
        if not config.is_causal:
            raise ValueError("NormSwapForCausalLM needs NormSwapConfig.is_causal=True, got False.")
        super().__init__(config)
        self.model = NormSwapModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: Cache | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        # `use_cache`, and the cache by its name before Transformers 5.24 (`past_key_values`), pass on in kwargs
        outputs = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, cache, **kwargs)
        hidden_states = outputs.last_hidden_state
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, kept, :])
        if self.config.final_logit_softcapping is not None:
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        loss = None
        if labels is not None:
            sequence_ids = packed_sequence_ids(
                attention_mask=attention_mask, position_ids=position_ids, seq_idx=kwargs.get("seq_idx")
            )
            if sequence_ids is not None and kwargs.get("shift_labels") is None:
                kwargs["shift_labels"] = next_token_labels(labels=labels, sequence_ids=sequence_ids)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
        )


HEADS = {  # each head's name: its model class, Auto class and Hub pipeline tag
    "base": (NormSwapModel, "AutoModel", "feature-extraction"),
    "masked-lm": (NormSwapForMaskedLM, "AutoModelForMaskedLM", "fill-mask"),
    "sequence-classification": (
        NormSwapForSequenceClassification,
        "AutoModelForSequenceClassification",
        "text-classification",
    ),
    "token-classification": (
        NormSwapForTokenClassification,
        "AutoModelForTokenClassification",
        "token-classification",
    ),
    "question-answering": (NormSwapForQuestionAnswering, "AutoModelForQuestionAnswering", "question-answering"),
    "causal-lm": (NormSwapForCausalLM, "AutoModelForCausalLM", "text-generation"),
}
AUTO_MAP = {"AutoConfig": "configuration_normswap.NormSwapConfig"} | {
    auto_class: f"modeling_normswap.{model_class.__name__}" for model_class, auto_class, _ in HEADS.values()
}
for _model_class, _auto_class, _ in HEADS.values():
    _model_class.register_for_auto_class(_auto_class)

__all__ = ["NormSwapPreTrainedModel", *(model_class.__name__ for model_class, _, _ in HEADS.values())]
