"""`CausalLM`, the small interface through which the rest of the engine sees a native model of any family,
and the machinery every family shares through it: rotary tables per attention kind, document masking
(`attention=document`), sliding-window masks, the chunked LM-head loss, regional compile.

The engine (activation checkpointing, regional compile, FSDP, fp8, the loop, evaluation, export) reaches a
model only through `CausalLM`'s methods: `blocks()` (the ModuleList of transformer blocks that checkpointing,
compile and FSDP wrap), `input_embedding()`, `output_units()` (final norm and LM head, one FSDP unit),
`tie_weights()`, `forward(input_ids) -> loss` (the chunked loss), `logits(input_ids)`, `flops_per_token`,
`parameter_counts`, `compile_blocks`, `reset_buffers`, `use_document_masking`. A family's model implements
`blocks`, `input_embedding` and `final_norm` over the shared blocks of utils/model/common/; every block is
called as `block(x, cos, sin, mask)` with its layer kind's rotary tables and mask. `HFCausalLM` puts the
same interface on transformers' own classes (`model_impl=hf`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from utils.model.common.masks import attention_mask, document_ids, positions_in_documents
from utils.model.common.norms import NORMS
from utils.model.common.rotary import rotary_tables, spec_inv_freq
from utils.model.lm_loss import ChunkedLMHeadLoss, LMHead, chunked_loss_only  # noqa: F401 (the head, shared)


class FlopsMixin:
    """FLOPs and parameter counts of any family's model (it has `spec` and `input_embedding()`)."""

    def parameter_counts(self) -> tuple[int, int]:
        """(all parameters, those doing matmul work: all but the input embedding lookup table)."""
        total = sum(p.numel() for p in self.parameters())
        return total, total - self.input_embedding().weight.numel() * (not self.spec.tie_word_embeddings)

    def flops_per_token(self, seq_len: int) -> float:
        """The family's count (utils/model/family.py Family.flops_per_token: PaLM's 6N + attention)."""
        from utils.model.families import family_of

        return family_of(self.spec).flops_per_token(self.spec, seq_len)

    def muon_parameters(self) -> list[torch.Tensor]:
        """The weight matrices of every block that the model's family names for Muon (`Family.muon_matrices`:
        its blocks' projection and MLP matrices), in module order; embeddings, the LM head, norms and biases
        stay with AdamW (utils/training/optim/muon.py asks this)."""
        from utils.model.activation_checkpointing import parameter_fqn
        from utils.model.families import family_of

        names = set(family_of(self.spec).muon_matrices(self.spec))
        out = []
        for block in self.blocks():
            for name, module in block.named_modules():
                if parameter_fqn(name) in names and module.weight.requires_grad:
                    out.append(module.weight)
        return out


class HFCausalLM(FlopsMixin):
    """The engine's interface on transformers' *ForCausalLM (`model_impl=hf`), mixed in before it: `forward(input_ids)
    -> loss` (transformers' own logits, final softcapping included, on every position but the last; cross-entropy
    in fp32 for a stable log-softmax under autocast), through transformers' own accessors (`base_model`,
    `get_input_embeddings`); `final_norm_name` is the trunk's final norm (utils/model/hf.py engine_class)."""

    final_norm_name = "norm"

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids=input_ids, use_cache=False).logits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.logits(input_ids)[:, :-1]
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1))

    def blocks(self):
        return self.base_model.layers

    def input_embedding(self):
        return self.get_input_embeddings()

    def output_units(self):
        return [self.base_model.get_submodule(self.final_norm_name), self.lm_head]

    def compile_blocks(self) -> None:
        for layer in self.blocks():
            layer.compile()


class CausalLM(FlopsMixin, nn.Module):
    """The engine's view of a native model. A family implements `blocks`, `input_embedding`, `final_norm`,
    creates `lm_head` (an LMHead) and ends its __init__ with `finish_init()`. Rotary tables are buffers (never
    saved), one cos/sin pair per attention kind its layers use, built by `reset_buffers()`."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.document_eos: int | None = None  # use_document_masking
        self.position_reset = False
        self.flex_attention = False
        self.kinds = tuple(sorted(set(spec.layer_kinds)))
        for kind in self.kinds:
            cos, sin = self._table_names(kind)
            self.register_buffer(cos, torch.empty(0), persistent=False)
            self.register_buffer(sin, torch.empty(0), persistent=False)

    # --- the family fills these in
    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def input_embedding(self) -> nn.Embedding:
        raise NotImplementedError

    def final_norm(self) -> nn.Module:
        raise NotImplementedError

    # --- shared
    def finish_init(self) -> None:
        """After the family built its modules: the head tied where the spec ties it, its softcapping, the
        rotary tables and the initial weights."""
        self.lm_head.softcap = float(self.spec.final_logit_softcapping)
        self.tie_weights()
        self.reset_parameters()

    def rotary_tables(self, kind: str, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the layers of `kind` ("full" | "sliding") for `positions` positions (fp32)."""
        return rotary_tables(spec_inv_freq(self.spec, kind), positions)

    @staticmethod
    def _table_names(kind: str) -> tuple[str, str]:
        return ("rotary_cos", "rotary_sin") if kind == "full" else (f"rotary_cos_{kind}", f"rotary_sin_{kind}")

    def init_weights(self) -> None:
        """transformers' initialisation: normal(0, initializer_range) for every Linear and Embedding (in module
        order), zero biases, every norm at its identity (utils/model/common/norms.py)."""
        std = self.spec.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, NORMS):
                module.reset_parameters()

    def output_units(self) -> list[nn.Module]:
        """What FSDP shards together after the blocks: the final norm and the LM head."""
        return [self.final_norm(), self.lm_head]

    def tie_weights(self) -> None:
        """Tied embeddings: the head is the input embedding's weight (after loading with `assign=True`, too)."""
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.input_embedding().weight

    def reset_buffers(self) -> None:
        """The rotary tables (not in any state dict): built here, and again after a meta-device model is
        materialised with `to_empty`, which leaves buffers uninitialised."""
        device = self.lm_head.weight.device
        for kind in self.kinds:
            cos, sin = self.rotary_tables(kind, self.spec.max_position_embeddings)
            cos_name, sin_name = self._table_names(kind)
            setattr(self, cos_name, cos.to(device))
            setattr(self, sin_name, sin.to(device))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.reset_buffers()
        if self.lm_head.weight.is_meta:
            return
        self.init_weights()

    def use_document_masking(self, eos_id: int, position_reset: bool = False, flex: bool | None = None) -> None:
        """`attention=document`: each token attends only within its own document of a packed sequence
        (documents end at `eos_id`); `position_reset`: rotary positions restart at every document. `flex`:
        FlexAttention with a block mask (default on CUDA) rather than SDPA with a dense boolean mask (CPU).
        A training-time choice: the weights and the exported model are the family's standard ones."""
        self.document_eos, self.position_reset = int(eos_id), position_reset
        self.flex_attention = torch.cuda.is_available() if flex is None else flex

    def attention_inputs(self, input_ids: torch.Tensor) -> dict[str, tuple]:
        """Per attention kind: (cos, sin, mask) for this batch (its documents, positions, window)."""
        T = input_ids.shape[1]
        docs = document_ids(input_ids, self.document_eos) if self.document_eos is not None else None
        positions = positions_in_documents(docs) if docs is not None and self.position_reset else None
        inputs = {}
        for kind in self.kinds:
            cos_name, sin_name = self._table_names(kind)
            cos, sin = getattr(self, cos_name), getattr(self, sin_name)
            if positions is not None:
                cos, sin = cos[positions][:, None], sin[positions][:, None]
            else:
                cos, sin = cos[:T], sin[:T]
            window = self.spec.sliding_window if kind == "sliding" else 0
            inputs[kind] = (cos, sin, attention_mask(T, docs, window, self.flex_attention, input_ids.device))
        return inputs

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        inputs = self.attention_inputs(input_ids)
        x = self.input_embedding()(input_ids)
        for kind, block in zip(self.spec.layer_kinds, self.blocks()):  # checkpointing wraps blocks from outside
            x = block(x, *inputs[kind])
        return self.final_norm()(x)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over every position but the last (ChunkedLMHeadLoss)."""
        hidden = self.hidden_states(input_ids)[:, :-1].reshape(-1, self.spec.hidden_size)
        return self.lm_head(hidden, input_ids[:, 1:].reshape(-1))

    def compile_blocks(self) -> None:
        """Regional compile: each block's forward is compiled, and the identical blocks share the compiled
        code, so the model compiles once per block shape instead of as one large graph."""
        for block in self.blocks():
            block.compile()
