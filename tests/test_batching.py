"""Batching modes (batching.py): length-grouped order, packed rows that keep sequences apart, the
combinations refused, kernels and attention refused where they cannot run, and a config-built model made
on its device."""

import numpy as np
import pytest
import torch

from ftbench.tasks import registry
from ftbench.data import batch_order
from ftbench.tasks.base import IGNORE_INDEX, TokenisedSplit
from ftbench.experiment import config as ftconfig
from ftbench.train import modeling, batching, trainer
from ftbench.errors import ConfigError, UnsupportedConfiguration
from ftbench.runspec import RunSpec
from test_families import llama_data, llama_spec  # noqa: F401 - llama_data is a fixture
from test_measurement import llama_model_def, tiny_llama

# Sequences of very different lengths, as review snippets are (2..30 tokens).
LENGTHS = [7, 30, 2, 12, 5, 19, 3, 25, 9, 4]


def variable_split(lengths=LENGTHS, vocab=1000, seed=0) -> TokenisedSplit:
    rng = np.random.default_rng(seed)
    return TokenisedSplit(input_ids=[rng.integers(1, vocab, size=n) for n in lengths])


# ---------------------------------------------------------------------------------------------------
# group_by_length


def test_grouped_order_sees_every_kept_example_once_per_epoch_in_similar_length_batches():
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 64, size=1000)
    global_batch = 16
    per_epoch = 1000 // global_batch
    batches = list(batch_order.grouped_order(lengths, global_batch, 2 * per_epoch, seed=3))
    for epoch in range(2):
        seen = np.concatenate(batches[epoch * per_epoch : (epoch + 1) * per_epoch])
        assert len(seen) == len(set(seen.tolist())) == per_epoch * global_batch
    plain = list(batch_order.batch_order(1000, global_batch, per_epoch, seed=3))

    def padding(order):
        return 1 - sum(lengths[b].sum() for b in order) / sum(lengths[b].max() * len(b) for b in order)

    assert padding(batches[:per_epoch]) < 0.1 < 0.4 < padding(plain)
    # Seeded: the same order again; long batches are not all at the start of the epoch.
    assert all((a == b).all() for a, b in zip(batches, batch_order.grouped_order(lengths, global_batch, 2 * per_epoch, seed=3)))
    maxima = [lengths[b].max() for b in batches[:per_epoch]]
    assert maxima != sorted(maxima, reverse=True)


# ---------------------------------------------------------------------------------------------------
# Packing


def test_pack_rows_fill_rows_without_splitting_a_sequence():
    rows = batch_order.pack_rows(LENGTHS, 32)
    assert sorted(i for row in rows for i in row) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in row) <= 32 for row in rows)
    assert len(rows) == 4  # 116 tokens: 4 rows of 32 at best
    assert batch_order.pack_rows(LENGTHS, None) == [list(range(len(LENGTHS)))]
    with pytest.raises(ValueError):
        batch_order.pack_rows([40], 32)


def test_packed_batch_counts_real_tokens_and_per_sequence_attention_terms():
    split = variable_split()
    batch = batching.collate("causal_lm", split, np.arange(len(LENGTHS)), 0, "pack", 32)
    rows, width = batch.inputs["input_ids"].shape
    assert batch.real_tokens == sum(LENGTHS)
    assert batch.sum_squared_lengths == sum(n * n for n in LENGTHS)
    assert batch.padded_tokens == rows * width and batch.capacity_tokens == rows * 32
    assert "attention_mask" not in batch.inputs  # the mask comes from the restarting position ids
    # One sequence's first token is never a target; every other real token is, once.
    assert int((batch.inputs["labels"] != IGNORE_INDEX).sum()) == sum(n - 1 for n in LENGTHS)
    free = batching.collate("causal_lm", split, np.arange(len(LENGTHS)), 0, "padding_free", 32)
    assert free.inputs["input_ids"].shape == (1, sum(LENGTHS)) and free.padded_tokens == free.real_tokens
    steps = [{"measured": True, "tokens": batch.real_tokens, "capacity_tokens": batch.capacity_tokens}]
    assert batching.packing_efficiency(steps) == pytest.approx(sum(LENGTHS) / (rows * 32))
    assert batching.packing_efficiency([{"measured": True, "tokens": 5, "capacity_tokens": 0}]) is None


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", ["pack", "padding_free"])
def test_packed_loss_equals_unpacked_loss_per_sequence_on_a_decoder(attention, mode):
    # use_cache off, as build_model sets it: transformers reads packed position ids only without a cache.
    model = tiny_llama(attn_implementation=attention, use_cache=False).eval()
    split = variable_split()
    indices = np.arange(len(LENGTHS))
    with torch.no_grad():
        padded = registry.family("causal_lm").collate(split, indices, 0)
        packed = batching.collate("causal_lm", split, indices, 0, mode, 32)
        # Per sequence, unpacked: each sequence alone, no padding at all.
        alone = [model(input_ids=torch.as_tensor(seq)[None], labels=torch.as_tensor(seq)[None]).loss.item()
                 for seq in split.input_ids]
        # Per sequence, packed: the token losses of the packed pass, grouped by sequence.
        logits = model(input_ids=packed.inputs["input_ids"], position_ids=packed.inputs["position_ids"]).logits
        token_loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), packed.inputs["labels"][:, 1:], ignore_index=IGNORE_INDEX,
            reduction="none")
        document = packed.inputs["position_ids"].eq(0).cumsum(-1)[:, 1:]  # which sequence each target is in
        packed_losses = {}
        for row in range(token_loss.shape[0]):
            scored = packed.inputs["labels"][row, 1:] != IGNORE_INDEX
            for doc in document[row, scored].unique().tolist():
                where = scored & (document[row] == doc)
                tokens = packed.inputs["input_ids"][row, 1:][where]
                packed_losses[tuple(tokens.tolist())] = token_loss[row, where].mean().item()
        assert len(packed_losses) == len(LENGTHS)
        for seq, expected in zip(split.input_ids, alone):
            assert packed_losses[tuple(seq[1:].tolist())] == pytest.approx(expected, rel=1e-4, abs=1e-5)
        # The batch loss too: the model's own loss of the packed batch equals that of the padded batch.
        assert model(**packed.inputs).loss.item() == pytest.approx(model(**padded.inputs).loss.item(), rel=1e-4)


def test_isolation_probe_refuses_a_model_that_lets_packed_sequences_see_each_other():
    model = tiny_llama(use_cache=False)
    batching.check_isolation(model, torch.device("cpu"))  # Llama honours packed position ids
    model.config.use_cache = True  # transformers then ignores packed position ids: the probe must see it
    with pytest.raises(UnsupportedConfiguration, match="not kept apart"):
        batching.check_isolation(model, torch.device("cpu"))
    model.config.use_cache = False

    class IgnoresPositions(torch.nn.Module):  # as a model whose attention reads no packed bounds would
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, position_ids=None):
            return self.inner(input_ids=input_ids)

    with pytest.raises(UnsupportedConfiguration, match="not kept apart"):
        batching.check_isolation(IgnoresPositions(model), torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------
# Combinations refused


def test_packing_an_encoder_classifier_is_refused_at_parse_time(tiny_config_factory):
    config = tiny_config_factory(matrix={"model": ["tiny"], "dataset": ["tiny"], "batching": ["pad", "pack"]})
    with pytest.raises(ConfigError, match=r"config key matrix\.batching\[1\].*classification pools one token"):
        ftconfig.validate_config(config)
    config = tiny_config_factory(matrix={"model": ["tiny"], "dataset": ["tiny"], "batching": ["group_by_length"]})
    ftconfig.validate_config(config)  # grouping works for every task


def test_packing_with_dataparallel_or_batch_search_is_refused_at_parse_time():
    with pytest.raises(ConfigError, match="DataParallel"):
        llama_spec(batching="pack", parallel="dp")
    with pytest.raises(ConfigError, match="auto_batch_size"):
        llama_spec(batching="padding_free", auto_batch_size=True)


@pytest.mark.parametrize("settings, reason", [
    ({"kernels": "liger"}, "Triton kernels, which need a CUDA GPU"),
    ({"attn_implementation": "flash_attention_2"}, "flash_attention_2 needs a CUDA GPU"),
    ({"attn_implementation": "flex_attention"}, "CUDA GPUs only"),
])
def test_gpu_only_kernels_and_attention_are_unsupported_rows_on_a_cpu(settings, reason):
    with pytest.raises(UnsupportedConfiguration, match=reason):
        modeling.check_supported(llama_spec(**settings), torch.device("cpu"))


def test_liger_without_the_package_is_an_unsupported_row(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(modeling, "package_available", lambda name: False)
    with pytest.raises(UnsupportedConfiguration, match="liger-kernel package"):
        modeling.check_supported(llama_spec(kernels="liger"), torch.device("cuda", 0))


# ---------------------------------------------------------------------------------------------------
# A config-built model is made on its device


def test_config_built_model_is_initialised_on_the_requested_device():
    # The meta device holds no data: a model built there was never initialised on the CPU and moved.
    spec = RunSpec(model="llama", method="full", model_def=llama_model_def())
    built = modeling.build_model(spec, None, torch.device("meta"), pad_token_id=0)
    assert {p.device.type for p in built.model.parameters()} == {"meta"}
    assert {p.dtype for p in built.model.parameters()} == {torch.float32}  # fp32 masters; precision is autocast
    assert built.total_params > 0


@pytest.mark.slow
def test_packed_and_grouped_runs_train_and_report_their_batching(llama_data):
    figures = {}
    for mode in ("pad", "group_by_length", "pack", "padding_free"):
        metrics, steps = trainer.train_run(llama_spec(batching=mode), llama_data)
        assert metrics["status"] == "ok", metrics["status_reason"]
        figures[mode] = metrics
    assert figures["pad"]["packing_efficiency"] is None
    assert 0 < figures["pack"]["packing_efficiency"] <= 1
    assert figures["padding_free"]["padding_fraction"] == 0.0
    # From this (pytest's) process start: at least the data and model load before the first step.
    assert all(m["overhead_s"] > m["load_time_s"] > 0 for m in figures.values())
