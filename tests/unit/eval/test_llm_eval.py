"""Generation and instruction-suite evaluators on tiny Llamas, random or with built weights."""

from __future__ import annotations

import math
from dataclasses import dataclass

import datasets
import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from fedfm.data.prompt import PromptConfig, format_prompt
from fedfm.errors import FedfmError, UnknownNameError
from fedfm.eval.llm import (
    choice_logliks,
    evaluate_held_out_domain,
    evaluate_instruction_items,
    evaluate_instructions,
    head_to_head,
    lm_nll,
    multiple_choice_loglik,
    reference_nlls,
    split_held_out_domain,
    text_nlls,
    text_scores,
)
from fedfm.models.generation import Reply, generate, generate_replies
from helpers.models import bigram_llama, chatml_tokenizer, constant_llama, tiny_llama

CORPUS = [
    "What is the capital of France? The capital of France is Paris.",
    "Summarize the following text in one sentence. Answer yes or no.",
    "A farmer has 12 apples and gives away 5. How many are left? #### 7",
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """Byte-level BPE (~350 tokens) with SmolLM2's special tokens and a ChatML template."""
    return chatml_tokenizer(CORPUS)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def yes7(tok) -> LlamaForCausalLM:
    """Greedily answers every chat prompt (which ends with "\\n") with "yes 7"."""
    return bigram_llama(tok, [*_ids(tok, "\n"), *_ids(tok, "yes 7"), tok.eos_token_id])


PROMPTS = [
    "What is the capital of France?",
    "Answer yes or no.",
    "A farmer has 12 apples and gives away 5. How many are left? Explain step by step.",
    "Hi",
    "Summarize the following text in one sentence.",
    "Paris",
]


def test_generation_order_and_batching_invariance(tok):
    model = tiny_llama(len(tok))
    prompts = [format_prompt(tok, p) for p in PROMPTS]
    one = generate(model, tok, prompts, max_new_tokens=8, batch_size=1)
    four = generate(model, tok, prompts, max_new_tokens=8, batch_size=4)
    # Left padding with a masked attention and positions from the mask gives the same greedy
    # tokens as unpadded batch-1 generation (weights are drawn peaked to rule out near-ties).
    assert one == four
    assert len(one) == len(prompts)
    assert one[2] == generate(model, tok, [prompts[2]], max_new_tokens=8)[0]
    assert len(set(one)) > 1  # different prompts, different continuations


def test_generation_stops_at_end_of_turn_and_accepts_bundles(tok, yes7):
    @dataclass
    class Bundle:
        model: torch.nn.Module
        tokenizer: object

    yes7.train()
    prompts = [format_prompt(tok, p) for p in PROMPTS[:3]]
    assert generate(Bundle(yes7, tok), None, prompts, max_new_tokens=10) == ["yes 7"] * 3
    assert yes7.training  # previous mode restored
    yes7.eval()
    assert generate(yes7, tok, [_ids(tok, prompts[0])], max_new_tokens=1) == ["yes"]
    with pytest.raises(FedfmError, match="tokenizer"):
        generate(yes7, None, prompts)


def _suite() -> datasets.Dataset:
    rows = [
        ("general", "rouge", "Say yes", "yes 7", [], ""),  # ROUGE-L 1
        ("general", "rouge", "Say it", "yes no", [], ""),  # LCS 1 of 2 and 2 words: 1/2
        ("math", "gsm8k", "12 - 5?", "12 - 5 = 7\n#### 7", [], "7"),  # right
        ("math", "gsm8k", "3 + 5?", "3 + 5 = 8", [], ""),  # answer from output: 8, wrong
        ("medical", "choice", "Is it?", "yes", ["yes", "no"], "yes"),  # right
        ("medical", "choice", "Is it not?", "no", ["yes", "no"], "no"),  # wrong
        ("medical", "choice", "Really?", "yes", ["no", "yes"], "yes"),  # right
    ]
    keys = ["domain", "metric", "instruction", "output", "choices", "answer"]
    data = {k: [r[i] for r in rows] for i, k in enumerate(keys)}
    data["input"] = [""] * len(rows)
    data["id"] = [str(i) for i in range(len(rows))]
    return datasets.Dataset.from_dict(data)


@pytest.mark.parametrize("choice_mode", ["generate", "loglik"])
def test_evaluate_instructions_per_domain(tok, yes7, choice_mode):
    res = evaluate_instructions(yes7, tok, _suite(), max_new_tokens=6, choice_mode=choice_mode)
    expected = {
        "rougeL": 0.75,
        "rougeL/general": 0.75,
        "gsm8k_acc": 0.5,
        "gsm8k_acc/math": 0.5,
        "acc": 2 / 3,
        "acc/medical": 2 / 3,
        "score/general": 0.75,
        "score/math": 0.5,
        "score/medical": 2 / 3,
        "score": (0.75 + 0.5 + 2 / 3) / 3,
        "n": 7.0,
        "n/general": 2.0,
        "n/math": 2.0,
        "n/medical": 3.0,
        # "yes 7" names "yes" (or is the likeliest label) for every medical item; gold is
        # yes, no, yes: the majority class scores 2/3, a uniform guess 1/2.
        "pred/medical/yes": 1.0,
        "pred/medical/no": 0.0,
        "majority/medical": 2 / 3,
        "uniform/medical": 0.5,
        # Recall 1 on yes, 0 on no; F1 0.8 on yes (precision 2/3), 0 on no.
        "bal_acc/medical": 0.5,
        "bal_acc": 0.5,
        "f1_macro/medical": 0.4,
        "f1_macro": 0.4,
        "bal_acc_se/medical": 0.0,
        "bal_acc_se": 0.0,
    }
    # Every generation ended with its end-of-turn token within the 6-token budget.
    generated = ["general", "math"] + (["medical"] if choice_mode == "generate" else [])
    expected |= {f"truncated/{d}": 0.0 for d in generated} | {"truncated": 0.0}
    # score's SE: general's two ROUGE values are not known by hand, so it is only bounded
    # by the two domains with known items (math 0/1: variance 1/2 over 2; medical 1,0,1).
    se = res.pop("score_se")
    known = (0.5 / 2 + (1 / 3) / 3) / 9  # var/n of math and medical, over 3 domains squared
    assert se**2 >= known - 1e-12
    assert res == pytest.approx(expected)


def test_evaluate_with_perplexity_and_held_out_domain(tok):
    model = tiny_llama(len(tok))
    suite = _suite()
    res = evaluate_instructions(model, tok, suite, max_new_tokens=2, with_ppl=True)
    assert {"ppl", "ppl/general", "ppl/math", "ppl/medical"} <= set(res)
    nll, n = lm_nll(model, tok, suite.select([2, 3]))
    assert res["ppl/math"] == pytest.approx(math.exp(nll / n), rel=1e-5)

    seen, held = split_held_out_domain(suite, "math")
    assert set(seen["domain"]) == {"general", "medical"} and held["domain"] == ["math"] * 2
    zero_shot = evaluate_held_out_domain(model, tok, suite, "math", max_new_tokens=2)
    assert set(zero_shot) == {
        *("gsm8k_acc", "gsm8k_acc/math", "score", "score/math", "n", "n/math"),
        *("truncated", "truncated/math", "score_se"),
    }
    with pytest.raises(FedfmError, match="not in dataset"):
        split_held_out_domain(suite, "law")


def test_per_item_nll_sums_to_the_perplexity_and_likelihood_only_generates_nothing(
    tok, monkeypatch
):
    model = tiny_llama(len(tok), init=0.02)
    suite = _suite()
    per = reference_nlls(model, tok, suite, PromptConfig(), batch_size=3)
    nll, n = lm_nll(model, tok, suite, PromptConfig(), batch_size=2)
    assert all(p is not None for p in per)
    assert sum(p[0] for p in per) == pytest.approx(nll, rel=1e-6)  # type: ignore[index]
    assert sum(p[1] for p in per) == n  # type: ignore[index]

    def no_generation(*args, **kw):
        raise AssertionError("likelihood_only generated")

    monkeypatch.setattr("fedfm.eval.llm.generate_replies", no_generation)
    res, items = evaluate_instruction_items(
        model, tok, suite, choice_mode="loglik", with_ppl=True, likelihood_only=True
    )
    # General and maths are not scored, only their references' NLL is measured.
    assert [it["metric"] for it in items] == ["nll"] * 4 + ["acc"] * 3
    assert [it["score"] is None for it in items] == [True] * 4 + [False] * 3
    assert res["score"] == res["score/medical"] and "score/general" not in res
    assert not any(k.startswith("truncated") for k in res)
    general = [it for it in items if it["domain"] == "general"]
    total = sum(it["nll"] for it in general), sum(it["nll_tokens"] for it in general)
    assert res["ppl/general"] == pytest.approx(math.exp(total[0] / total[1]), rel=1e-5)
    assert [it["nll_tokens"] for it in items] == [p[1] for p in per]  # type: ignore[index]
    assert [it["nll"] for it in items] == pytest.approx([p[0] for p in per])  # type: ignore[index]
    # Items without a score are left out of a head-to-head.
    assert head_to_head(items, items)["n"] == 3
    with pytest.raises(FedfmError, match="likelihood_only needs"):
        evaluate_instruction_items(model, tok, suite, with_ppl=True, likelihood_only=True)


def test_text_nll_of_uniform_logits_is_log_vocab_per_token_after_the_first(tok):
    model = tiny_llama(len(tok))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: uniform over the vocabulary
    texts = ["What is the capital of France?", "Paris", "yes"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    got = text_nlls(model, tok, texts, max_tokens=4, batch_size=2)
    for (nll, n, scored), x in zip(got, ids, strict=True):
        k = min(len(x), 4)
        assert n == k - 1  # the first token has no prefix to be predicted from
        assert nll == pytest.approx(n * math.log(len(tok)), rel=1e-5)
        assert scored == tok.decode(x[:4])
    assert len(ids[0]) > 4 and got[0][1] == 3  # a long text is scored on its first tokens


def test_top1_token_accuracy_of_a_text_by_hand(tok):
    """A model that always predicts one token: a scored token is a top-1 hit iff it is that
    token; the NLL comes from the same pass (one log-probability per scored token)."""
    text = "the capital of the country of the river"
    x = _ids(tok, text)
    scored = x[1:]  # the first token is not predicted
    the = max(set(scored), key=scored.count)
    assert scored.count(the) >= 2 and len(set(scored)) > 2
    logprobs = torch.log_softmax(torch.linspace(0.0, 1.0, len(tok)), -1)
    top = int(torch.argmax(logprobs))
    logprobs[[top, the]] = logprobs[[the, top]]  # ``the`` is the one top-1 prediction
    model = constant_llama(len(tok), logprobs)
    got = text_scores(model, tok, [text, "France"], max_tokens=64, batch_size=2)
    assert got[0].tokens == len(scored) and got[0].top1 == scored.count(the)
    assert got[0].nll == pytest.approx(-sum(float(logprobs[t]) for t in scored), rel=1e-4)
    assert got[0].text == text
    # text_nlls is the same pass without the hits
    assert text_nlls(model, tok, [text], max_tokens=64)[0] == pytest.approx(got[0][:3])
    one = _ids(tok, "France")
    assert got[1].tokens == len(one) - 1 and got[1].top1 == one[1:].count(the)


def test_unknown_metric_is_refused_before_generation(tok, yes7):
    bad = _suite().map(lambda r: {"metric": "bleu" if r["id"] == "0" else r["metric"]})
    with pytest.raises(UnknownNameError, match="bleu"):
        evaluate_instructions(yes7, tok, bad)


def test_lm_nll_independent_of_batch_size(tok):
    model = tiny_llama(len(tok), init=0.02)
    suite = _suite()
    nll1, n1 = lm_nll(model, tok, suite, PromptConfig(), batch_size=1)
    nll3, n3 = lm_nll(model, tok, suite, PromptConfig(), batch_size=3)
    assert n1 == n3
    assert nll1 == pytest.approx(nll3, rel=1e-5)


def test_multiple_choice_sum_rule_against_the_per_token_mean(tok):
    """A hand case of TREC's collapse: the mean favours the multi-token label, the sum not."""
    vocab = len(tok)
    a, b, end = _ids(tok, "yes")[0], _ids(tok, "no")[0], tok.convert_tokens_to_ids("<|im_end|>")
    # log p(a) = -1.0, log p(b) = -0.8, log p(end of turn) = -2.0 at every position; the other
    # tokens share the remaining mass equally.
    rest = math.log((1 - math.exp(-1.0) - math.exp(-0.8) - math.exp(-2.0)) / (vocab - 3))
    logprobs = torch.full((vocab,), rest)
    logprobs[a], logprobs[b], logprobs[end] = -1.0, -0.8, -2.0
    model = constant_llama(vocab, logprobs)
    prompt = format_prompt(tok, "Pick one")
    choices = ["yes", "nono"]  # one token "yes" vs two tokens "no" "no"
    assert _ids(tok, "nono") == [b, b]
    scores = choice_logliks(model, tok, prompt, choices)
    # Each continuation ends with the end-of-turn token, as a reply does in training.
    assert [sc.tokens for sc in scores] == [2, 3]
    assert [sc.text for sc in scores] == ["yes<|im_end|>", "nono<|im_end|>"]
    assert [sc.loglik for sc in scores] == pytest.approx([-3.0, -3.6], abs=1e-4)
    # Sum: -3.0 > -3.6 picks "yes"; per-token mean: -1.2 > -1.5 picks the longer "nono".
    assert multiple_choice_loglik(model, tok, prompt, choices) == 0
    assert multiple_choice_loglik(model, tok, prompt, choices, norm="none") == 0
    assert multiple_choice_loglik(model, tok, prompt, choices, norm="token_mean") == 1
    # Per UTF-8 byte of label and marker: -3.0 / 13 > -3.6 / 14.
    assert multiple_choice_loglik(model, tok, prompt, choices, norm="bytes") == 0
    with pytest.raises(FedfmError, match="choice norm"):
        multiple_choice_loglik(model, tok, prompt, choices, norm="char")  # type: ignore[arg-type]


def test_multiple_choice_batched_matches_one_by_one_reference(tok):
    model = tiny_llama(len(tok), init=0.02)
    prompt = format_prompt(tok, "What is the capital of France?")
    choices = ["Paris", "The capital of France is Paris.", "no", "12 apples"]
    batched = choice_logliks(model, tok, prompt, choices, batch_size=3)
    p = _ids(tok, prompt)
    for sc, choice in zip(batched, choices, strict=True):
        score, n = sc.loglik, sc.tokens
        c = [*_ids(tok, choice), tok.convert_tokens_to_ids("<|im_end|>")]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + c])).logits[0], -1)
        ref = sum(float(logp[len(p) - 1 + j, t]) for j, t in enumerate(c))
        assert n == len(c)
        assert score == pytest.approx(ref, abs=1e-4)


def test_replies_say_whether_the_budget_cut_them(tok, yes7):
    prompts = [format_prompt(tok, p) for p in PROMPTS[:2]]
    assert generate_replies(yes7, tok, prompts, max_new_tokens=1) == [Reply("yes", True)] * 2
    # "yes", " 7", end of turn: three tokens end the reply by itself.
    assert generate_replies(yes7, tok, prompts, max_new_tokens=3) == [Reply("yes 7", False)] * 2


def test_a_gsm8k_reply_cut_before_its_answer_is_truncated_not_read_for_a_number(tok, yes7):
    rows = {
        "domain": ["math", "spam"],
        "metric": ["gsm8k", "choice"],
        "instruction": ["12 - 5?", "Spam?"],
        "output": ["12 - 5 = 7\n#### 7", "ham"],
        "choices": [[], ["spam", "ham"]],
        "answer": ["7", "ham"],
        "input": ["", ""],
        "id": ["m", "s"],
    }
    suite = datasets.Dataset.from_dict(rows)
    # Two tokens: "yes 7" without its end-of-turn token. Its last number is the answer, but
    # the reply was cut: no final number, score 0, counted under truncated.
    cut, items = evaluate_instruction_items(yes7, tok, suite, max_new_tokens=2)
    assert cut["gsm8k_acc/math"] == 0.0 and cut["truncated/math"] == 1.0
    assert items[0]["truncated"] and items[0]["score"] == 0.0
    done = evaluate_instructions(yes7, tok, suite, max_new_tokens=3)
    assert done["gsm8k_acc/math"] == 1.0 and done["truncated/math"] == 0.0
    # Per-domain budgets: the same result with only the maths domain given three tokens.
    mixed = evaluate_instructions(yes7, tok, suite, max_new_tokens=2, budgets={"math": 3})
    assert mixed["gsm8k_acc/math"] == 1.0 and mixed["truncated/spam"] == 1.0
    # "yes 7" names neither spam nor ham: the histogram has a bin for that.
    assert done["pred/spam/(none)"] == 1.0 and done["pred/spam/ham"] == 0.0
    assert done["majority/spam"] == 1.0 and done["uniform/spam"] == 0.5
    assert items[1]["label"] == "(none)"
