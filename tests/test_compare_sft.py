"""scripts/compare_sft.py: ftbench trains on the tokens TRL's SFTTrainer trains on, and its first step has the same
loss, for each instruction format under a ChatML and a Llama 3 template, on the CPU (a tiny config-built Llama and a
BPE tokenizer trained offline). Skipped where TRL is not installed (requirements-compare.txt)."""

import sys

import pytest

from conftest import ROOT

pytest.importorskip("trl")
sys.path.insert(0, str(ROOT / "scripts"))
import compare_sft  # noqa: E402  (the script, importable once scripts/ is on the path)


def test_a_row_of_other_tokens_or_another_mask_is_reported_with_its_positions():
    ftbench = [([1, 2, 3, 4], [1, 0, 1, 1]), ([5, 6, 7], [0, 1, 1])]
    trl = [([1, 2, 3, 4], [0, 0, 1, 1]),  # position 0 differs: no target in either, not a difference
           ([5, 6, 7], [0, 0, 1]),  # position 1 differs
           ([5, 6, 8], [0, 1, 1])]  # its tokens part from ftbench's nearest row at position 2
    first, second, third = compare_sft.compare_rows(trl, ftbench)
    assert first == {"row": 0, "same_ids": True, "mask_differs_at": [], "trained": 2, "ftbench_trained": 2}
    assert second["mask_differs_at"] == [1] and (second["trained"], second["ftbench_trained"]) == (1, 2)
    assert third == {"row": 2, "same_ids": False, "ids_part_at": 2, "trl_length": 3, "ftbench_length": 3}


def test_a_pair_passes_only_with_equal_masks_and_losses_within_the_tolerance():
    agreeing = {"masks_equal": True, "trl_loss": 2.0, "ftbench_loss": 2.0005, "trl_packed_loss": 2.0,
                "ftbench_packed_loss": 2.0}
    assert compare_sft.check_passes(agreeing)
    assert not compare_sft.check_passes({**agreeing, "masks_equal": False})
    assert not compare_sft.check_passes({**agreeing, "ftbench_loss": 2.002})
    assert not compare_sft.check_passes({**agreeing, "ftbench_packed_loss": 1.998})


def test_chatml_with_generation_markers_renders_as_the_plain_template_and_marks_each_turn_after_its_prompt(tmp_path):
    """TRL's assistant mask from the marked ChatML (what SFTTrainer is given) covers each assistant turn's content and
    its <|im_end|> line end, and renders the conversation exactly as the plain template ftbench reads."""
    tokenizer = compare_sft.build_tokenizer(tmp_path, "chatml", compare_sft.corpus_of(compare_sft.CHECK_ROWS), 400)
    rows = compare_sft.CHECK_ROWS["conversational"]
    assert compare_sft.same_rendering(tokenizer, rows, compare_sft.chatml_template(True))
    messages = rows[2]["messages"]  # two assistant turns
    out = tokenizer.apply_chat_template(messages, chat_template=compare_sft.chatml_template(True), tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    trained = tokenizer.decode([token for token, bit in zip(ids, mask) if bit])
    assert trained == "An apple.<|im_end|>\nA pear, then.<|im_end|>\n"


@pytest.mark.slow
def test_sfttrainer_and_ftbench_train_the_same_tokens_with_the_same_first_step_loss(tmp_path):
    """Every format under both templates: the same token ids and trained masks row by row, first-step losses within
    1e-3 (fp32), unpacked and packed. Then ftbench with loss_on: all on the same rows: its masks and loss must come
    apart from SFTTrainer's completion-only ones, so the check can fail."""
    results = compare_sft.check(compare_sft.parse_args(["check"]), tmp_path)
    assert [(r["template"], r["format"]) for r in results] == [
        (template, row_format) for template in compare_sft.TEMPLATES for row_format in compare_sft.FORMATS]
    for result in results:
        assert result["masks_equal"], result["rows_compared"]
        assert compare_sft.check_passes(result), result
        assert all(sum(mask[1:]) for _, mask in result["rows_trl"])  # every row trains something
    assert len({round(r["trl_loss"], 2) for r in results}) > 4  # the tiny model's losses are not all ln(vocabulary)

    completion_only = next(r for r in results if (r["template"], r["format"]) == ("llama3", "prompt_completion"))
    every_token = compare_sft.ftbench_side(tmp_path / "model-llama3", tmp_path / "data-llama3-prompt_completion",
                                           "prompt_completion", compare_sft.CHECK_SEQ_LEN, tmp_path / "all",
                                           {"loss_on": "all"})
    assert all(row["mask_differs_at"] for row in compare_sft.compare_rows(completion_only["rows_trl"], every_token["rows"]))
    assert abs(every_token["loss"] - completion_only["trl_loss"]) > 10 * compare_sft.LOSS_TOLERANCE
