"""Metrics against values computed by hand."""

from __future__ import annotations

import math

import datasets
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fedfm.data.prompt import PromptConfig
from fedfm.errors import FedfmError
from fedfm.eval.llm import lm_nll
from fedfm.eval.metrics import (
    METRICS,
    accuracy,
    balanced_accuracy,
    choice_accuracy,
    class_balanced_scores,
    exact_match,
    gsm8k_correct,
    gsm8k_number,
    macro_f1,
    mean_rouge_l,
    perplexity,
    pick_choice,
    rmse,
    rouge_l,
)


def test_rouge_l_by_hand():
    # LCS("the cat sat on the mat", "the cat lay on the mat") = "the cat on the mat" = 5 words;
    # P = R = 5/6, so F = 5/6.
    assert rouge_l("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    # LCS = 2, P = 2/2, R = 2/4, F = 2PR / (P + R) = 1 / 1.5 = 2/3.
    assert rouge_l("the cat", "the cat sat down") == pytest.approx(2 / 3)
    # Stemming is on: cats/cat and jumped/jumps share stems. Case and punctuation are ignored.
    assert rouge_l("Cats jumped!", "cat jumps") == pytest.approx(1.0)
    assert rouge_l("", "anything") == 0.0
    assert mean_rouge_l(["the cat", "a b"], ["the cat sat down", "a b"]) == pytest.approx(
        (2 / 3 + 1) / 2
    )


def test_exact_match_squad_normalisation():
    assert exact_match("The  Eiffel tower!", "eiffel Tower") == 1.0
    assert exact_match("an apple.", "Apple") == 1.0
    assert exact_match("apples", "apple") == 0.0


def test_choice_accuracy_cases():
    assert choice_accuracy("Yes.", ["yes", "no"], "yes") == 1
    assert choice_accuracy("The answer: NO", ["yes", "no"], "yes") == 0
    # Two labels named: the first one in the text counts.
    assert pick_choice("It is positive, not negative.", ["negative", "positive"]) == 1
    assert choice_accuracy("negative rather than positive", ["positive", "negative"], 1) == 1
    # Whole words only, and the longer of two choices starting at the same place wins.
    assert pick_choice("unknown", ["no", "known"]) is None
    assert pick_choice("no change here", ["no", "no change"]) == 1
    # Letter labels survive (articles are not stripped here, unlike exact match).
    assert pick_choice("(B) Paris", ["A", "B"]) == 1
    assert choice_accuracy("I cannot say", ["yes", "no"], "no") == 0
    with pytest.raises(FedfmError, match="not one of the choices"):
        choice_accuracy("yes", ["yes", "no"], "maybe")


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("She pays 3 * 4 = 12 dollars.\n#### 1,234", "1234"),
        ("The answer is $18.", "18"),
        ("So she has 2 + 1 = 3.0", "3"),
        ("12.50 dollars", "12.5"),
        ("The temperature is -5 degrees", "-5"),
        ("pages 3-4", "4"),
        ("#### 7 and then 9", "7"),
        ("no digits", None),
    ],
)
def test_gsm8k_number_extraction(text, number):
    assert gsm8k_number(text) == number


def test_gsm8k_correct():
    gold = "Natalia sold 48/2 = 24 clips in May.\nAltogether 48+24 = 72 clips.\n#### 72"
    assert gsm8k_correct("She sold 72 clips in total.", gold)
    assert gsm8k_correct("The answer is 72.0", 72)
    assert not gsm8k_correct("She sold 24 clips.", gold)
    assert not gsm8k_correct("no idea", gold)


def test_classification_and_regression_metrics():
    y_true = [0, 0, 1, 1, 2, 2]
    y_pred = [0, 1, 1, 1, 2, 0]
    # F1 per class: 0: P=1/2 R=1/2 -> 1/2; 1: P=2/3 R=1 -> 4/5; 2: P=1 R=1/2 -> 2/3.
    assert macro_f1(y_true, y_pred) == pytest.approx((1 / 2 + 4 / 5 + 2 / 3) / 3)
    assert accuracy(y_true, y_pred) == pytest.approx(4 / 6)
    assert rmse([1.0, 2.0, 3.0], [1.0, 2.0, 5.0]) == pytest.approx(math.sqrt(4 / 3))
    assert METRICS.get("macro_f1") is macro_f1
    with pytest.raises(FedfmError, match="differ in length"):
        accuracy([1, 2], [1])


def test_perplexity_formula():
    assert perplexity(3 * math.log(5.0), 3) == pytest.approx(5.0)
    with pytest.raises(FedfmError, match="at least one token"):
        perplexity(1.0, 0)


def _word_tokenizer() -> PreTrainedTokenizerFast:
    words = ["<pad>", "<eos>", "<unk>", "what", "is", "two", "plus", "three", "five", "###"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def test_uniform_logits_have_perplexity_equal_to_vocab_size():
    tok = _word_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0 -> uniform over the 10 tokens
    ds = datasets.Dataset.from_dict(
        {
            "instruction": ["what is two plus three", "what is two"],
            "input": ["", ""],
            "output": ["five", "two plus three five"],
        }
    )
    model.train()
    nll, n = lm_nll(model, tok, ds, PromptConfig(use_chat_template=False), batch_size=2)
    assert model.training  # training mode restored
    assert n == (1 + 1) + (4 + 1)  # response words + eos per row
    assert nll == pytest.approx(n * math.log(10), rel=1e-5)
    assert perplexity(nll, n) == pytest.approx(10.0, rel=1e-5)


def test_class_balanced_scores_by_hand():
    # Gold a,a,a,b; the answers a,a,b,(none). Recall a 2/3, b 0: balanced accuracy 1/3.
    # F1 over the gold classes: a (precision 1, recall 2/3) 0.8, b (precision 0) 0 -> 0.4.
    got = class_balanced_scores(["a", "a", "a", "b"], ["a", "a", "b", "(none)"])
    se = math.sqrt((2 / 3) * (1 / 3) / 3 + 0.0) / 2
    assert got == pytest.approx({"bal_acc": 1 / 3, "f1_macro": 0.4, "bal_acc_se": se})
    # Always the majority class: accuracy 3/4, balanced accuracy 1/2 (one class of two).
    assert balanced_accuracy(["a", "a", "a", "b"], ["a"] * 4) == pytest.approx(0.5)
