"""The recipe of a run: which dtype each kind of tensor is kept in, decided once from its settings.

Everything that depends on dtypes reads it from here: the model build (train/modeling.py), the autocast and
FSDP2 policies (train/devices.py, train/fsdp.py), the Trainer engine (train/hf_engine.py), the memory estimate
(measure/memory_estimate.py), the plan and the row's recipe columns. The defaults follow the convention of the
tools users train with, so a row measures what their own script would run:

| method | precision       | frozen base              | trainable | autocast | master weights | optimizer state |
|--------|-----------------|--------------------------|-----------|----------|----------------|-----------------|
| full   | fp32            | -                        | fp32      | -        | -              | fp32            |
| full   | bf16 / fp16     | -                        | fp32      | 16-bit   | yes            | fp32            |
| full   | bf16_true       | -                        | bf16      | -        | no             | bf16            |
| lora   | fp32            | fp32                     | fp32      | -        | -              | fp32            |
| lora   | bf16 / fp16     | 16-bit (lora_base_dtype) | fp32      | 16-bit   | yes            | fp32            |
| lora   | bf16_true       | bf16                     | bf16      | -        | no             | bf16            |
| qlora  | bf16 / fp16     | nf4 / fp4 (+ fp32 rest)  | fp32      | 16-bit   | yes            | fp32            |
| qlora  | fp32            | nf4 / fp4 (+ fp32 rest)  | fp32      | -        | -              | fp32            |

- full fine-tuning under bf16/fp16 is mixed precision (transformers' Trainer, torchtune's mixed recipes): fp32
  weights are the masters the optimizer updates, the forward pass runs under autocast.
- LoRA under bf16/fp16 is PEFT's convention (Axolotl, LLaMA-Factory, Unsloth and torchtune do the same): the
  frozen base is loaded in the 16-bit dtype, the adapters are fp32 (peft's ``autocast_adapter_dtype``) and the
  step runs under autocast. ``lora_base_dtype: fp32`` keeps the frozen base in fp32 instead (TRL's SFTTrainer
  default when given a bare model id): twice the base's memory.
- QLoRA: bitsandbytes' 4-bit base computing in the run's compute dtype; peft's k-bit preparation keeps the layers
  that are not quantised (norms, embeddings, the head) in fp32 and the adapters are fp32.
- Trainable parameters other than the adapters (a new classification head kept trainable by peft) follow the
  adapters: fp32 masters.

Torch-free: the plan and the row's columns need it at parse time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ftbench.runspec import RunSpec, compute_dtype

# Bytes of one element of each dtype a recipe names (4-bit weights: half a byte, constants apart).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "nf4": 0.5, "fp4": 0.5}


@dataclass(frozen=True)
class Recipe:
    """Which dtype each kind of tensor of a run is kept in (see the module's table)."""

    frozen_dtype: str | None  # the frozen base weights; None when nothing is frozen (full fine-tuning)
    trainable_dtype: str  # the parameters the optimizer updates
    autocast_dtype: str | None  # the forward pass's autocast dtype; None: no autocast
    master_weights: bool  # the optimizer updates fp32 masters of weights that compute in 16 bits
    optimizer_state_dtype: str  # AdamW's moments, SGD's momentum
    compute_dtype: str  # what the matrix multiplications run in

    @property
    def frozen_bytes(self) -> float:
        """Bytes per frozen, unquantised weight: the frozen dtype's, or fp32 for what a 4-bit base leaves unquantised."""
        if self.frozen_dtype is None or self.frozen_dtype in ("nf4", "fp4"):
            return 4
        return DTYPE_BYTES[self.frozen_dtype]

    @property
    def trainable_bytes(self) -> float:
        """Bytes per trainable parameter, and per gradient (gradients take their parameter's dtype)."""
        return DTYPE_BYTES[self.trainable_dtype]

    @property
    def sixteen_bit_base(self) -> bool:
        """The unquantised frozen weights are 16-bit themselves: autocast makes no copies of them, and the
        embeddings' output (so the residual stream) is 16-bit."""
        return self.frozen_dtype in ("bf16", "fp16")

    def text(self) -> str:
        """The recipe in one line (recipe_text)."""
        return recipe_text(self.frozen_dtype, self.trainable_dtype, self.autocast_dtype, self.master_weights,
                           self.optimizer_state_dtype)

    def columns(self) -> dict:
        """The row's recipe columns (report/columns.py documents them)."""
        return {f"recipe_{key}": value for key, value in asdict(self).items()}


def lora_base_in_compute_dtype(spec: RunSpec) -> bool:
    """A LoRA run's frozen base is loaded in its 16-bit autocast dtype (the default), not fp32."""
    return spec.method == "lora" and spec.precision in ("bf16", "fp16") and spec.lora_base_dtype != "fp32"


def recipe_of(spec: RunSpec) -> Recipe:
    """The run's recipe (the module's table)."""
    compute = compute_dtype(spec.precision)
    if spec.method == "qlora":
        compute = spec.qlora_compute_dtype or compute
    if spec.precision == "bf16_true":
        frozen = None if spec.method == "full" else "bf16"
        state = "int8" if spec.optimizer in ("adamw_8bit", "paged_adamw_8bit") else "bf16"
        return Recipe(frozen, "bf16", None, False, state, "bf16")
    state = "int8" if spec.optimizer in ("adamw_8bit", "paged_adamw_8bit") else "fp32"
    autocast = spec.precision if spec.precision in ("bf16", "fp16") else None
    if spec.method == "full":
        frozen = None
    elif spec.method == "qlora":
        frozen = spec.qlora_quant_type
    else:
        frozen = spec.precision if lora_base_in_compute_dtype(spec) else "fp32"
    return Recipe(frozen, "fp32", autocast, autocast is not None, state, compute)


def recipe_text(frozen: str | None, trainable: str | None, autocast: str | None, master_weights, state: str | None) -> str | None:
    """One line a reader can hold against their own training script: "base bf16, trains fp32 (masters), autocast bf16,
    AdamW state fp32". None when nothing is known (a row from before recipes were recorded)."""
    if not trainable:
        return None
    parts = ([f"base {frozen}"] if frozen else []) + [f"trains {trainable}" + (" (masters)" if master_weights is True else "")]
    parts.append(f"autocast {autocast}" if autocast else "no autocast")
    if state:
        parts.append(f"optimizer state {state}")
    return ", ".join(parts)


# What each recipe column means, for report/columns.py and config/README.md.
RECIPE_COLUMNS = {
    "recipe_frozen_dtype": "dtype the frozen base weights were kept in (nf4/fp4: QLoRA's 4-bit base, its other layers fp32); "
                           "null for full fine-tuning",
    "recipe_trainable_dtype": "dtype of the trained parameters and their gradients (fp32 masters under mixed precision)",
    "recipe_autocast_dtype": "dtype the forward pass ran in under autocast; null: no autocast (fp32, bf16_true)",
    "recipe_master_weights": "the optimizer updated fp32 master weights of layers that computed in 16 bits",
    "recipe_optimizer_state_dtype": "dtype of the optimizer's state (AdamW's moments, SGD's momentum; int8: bitsandbytes' 8-bit optimizers)",
    "recipe_compute_dtype": "dtype the matrix multiplications ran in",
}
