"""The foundation-model handle: named live adapters on one shared tiny Llama."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import fedfm.fm.bases as fmod
from fedfm.config import load_config
from fedfm.core.train import local_train
from fedfm.data.prompt import PromptConfig
from fedfm.engine import build
from fedfm.errors import ConfigError, FedfmError, UnknownNameError
from fedfm.models.causal_lm import small_tokenizer
from fedfm.models.lora import LoraConfigSpec
from fedfm.tasks.base import HasFoundationModel, capable
from helpers.bases import tiny_task
from helpers.models import TINY_FM_LORA, randomize, tiny_fm

SPEC = TINY_FM_LORA


def _ids() -> torch.Tensor:
    return torch.randint(3, 800, (2, 7), generator=torch.Generator().manual_seed(1))  # (2, 7)


def test_two_active_adapters_compute_the_hand_built_sum() -> None:
    fm = tiny_fm()
    fm.add_adapter("rect", seed=1)
    fm.add_adapter("self", seed=2, lora=LoraConfigSpec(r=2, alpha=6, dropout=0.0))
    randomize(fm, "rect", 3)
    randomize(fm, "self", 4)
    layer = fm.model.base_model.model.model.layers[1].self_attn.v_proj
    seen: dict[str, torch.Tensor] = {}

    def grab(module: Any, args: Any, out: torch.Tensor) -> None:
        seen["h"], seen["out"] = args[0].detach(), out.detach()

    handle = layer.register_forward_hook(grab)
    try:
        with fm.use(["rect", "self"]) as model, torch.no_grad():
            model(input_ids=_ids())
    finally:
        handle.remove()
    h = seen["h"]  # (2, 7, 32): the layer's input inside the full forward pass
    a_r, b_r = layer.lora_A["rect"].weight, layer.lora_B["rect"].weight  # (4, 32), (out, 4)
    a_s, b_s = layer.lora_A["self"].weight, layer.lora_B["self"].weight  # (2, 32), (out, 2)
    expected = h @ layer.base_layer.weight.T  # W0·h
    expected = expected + (8 / 4) * (h @ a_r.T @ b_r.T)  # + s_r·B_r·A_r·h
    expected = expected + (6 / 2) * (h @ a_s.T @ b_s.T)  # + s_s·B_s·A_s·h
    assert torch.allclose(seen["out"], expected, atol=1e-6)
    # Each alone differs from both: the forward pass really uses the two.
    with torch.no_grad():
        with fm.use(["rect", "self"]) as model:
            both = model(input_ids=_ids()).logits
        with fm.use(["rect"]) as model:
            only_r = model(input_ids=_ids()).logits
        with fm.use([]) as model:
            base = model(input_ids=_ids()).logits
    assert not torch.allclose(both, only_r, atol=1e-5)
    assert not torch.allclose(only_r, base, atol=1e-5)


def test_new_adapters_never_change_existing_ones_and_start_inactive() -> None:
    fm = tiny_fm()
    fm.add_adapter("client-0", seed=1)
    randomize(fm, "client-0", 5)
    fm.set_active(["client-0"], ["client-0"])
    before = fm.get_adapter("client-0")
    fm.add_adapter("client-1", seed=2)
    assert fm.ensure_adapter("client-1", seed=9) is False  # exists: untouched
    assert fm.ensure_adapter("client-2", seed=3) is True
    fm.reset_adapter("client-1", seed=4)
    fm.load_adapter("client-3", None, seed=6)
    after = fm.get_adapter("client-0")
    assert all(torch.equal(before[k], after[k]) for k in before)
    # A new adapter starts inactive and frozen; the previous choice is kept.
    assert fm.active == ["client-0"] and fm.trainable == ["client-0"]
    assert sorted(fm.adapters()) == ["client-0", "client-1", "client-2", "client-3"]


def test_seeded_init_is_reproducible_and_b_starts_at_zero() -> None:
    fm = tiny_fm()
    fm.add_adapter("a", seed=7)
    fm.add_adapter("b", seed=7)
    fm.add_adapter("c", seed=8)
    a, b, c = (fm.get_adapter(n) for n in "abc")
    assert sorted(a) == sorted(b) == sorted(c)  # keys never name the adapter
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "lora_A" in k)
    assert all(float(v.abs().sum()) == 0 for k, v in a.items() if "lora_B" in k)
    randomize(fm, "a", 1)
    fm.reset_adapter("a", seed=7)
    assert all(torch.equal(fm.get_adapter("a")[k], b[k]) for k in b)
    # A client with no stored adapter gets the seeded init, not what the slot held before.
    randomize(fm, "b", 2)
    fm.load_adapter("b", {}, seed=7)
    assert all(torch.equal(fm.get_adapter("b")[k], a[k]) for k in a)
    fm.load_adapter("b", fm.get_adapter("c"), seed=0)
    assert all(torch.equal(fm.get_adapter("b")[k], c[k]) for k in c)


def test_use_switches_and_restores_and_trains_only_the_trainable_adapter() -> None:
    fm = tiny_fm()
    fm.add_adapter("global", seed=1)
    fm.add_adapter("private", seed=2)
    randomize(fm, "global", 3)
    fm.set_active(["global"], [])
    g0, p0 = fm.get_adapter("global"), fm.get_adapter("private")
    batch = {"input_ids": _ids(), "labels": _ids()}
    cfg = load_config({}).train.model_copy(update={"optimizer": "adamw", "lr": 1e-2})

    def loss(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        out = model(**b)
        return out.loss, out

    with fm.use(["global", "private"], trainable=["private"]) as model:
        assert fm.active == ["global", "private"] and fm.trainable == ["private"]
        local_train(model, itertools.repeat(batch), loss, cfg, steps=3)
    assert fm.active == ["global"] and fm.trainable == []  # restored
    g1, p1 = fm.get_adapter("global"), fm.get_adapter("private")
    assert all(torch.equal(g0[k], g1[k]) for k in g0)
    assert any(not torch.equal(p0[k], p1[k]) for k in p0)
    assert set(fm.get_adapters(["global", "private"])) == {"global", "private"}


def test_base_loaded_once_and_shared_by_every_handle_and_the_fedit_model(tmp_path) -> None:
    cfg = load_config(
        {
            "name": "fm",
            "out_dir": str(tmp_path),
            "algorithm": "fedavg",
            "task": {
                "kind": "instruction",
                "model": "tiny-llama",
                "model_args": {"vocab": "small", "hidden": 32, "layers": 1, "heads": 2, "seed": 9},
                "source_options": {"per_domain_train": 4, "per_domain_test": 2},
                "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
            },
        }
    )
    task = build(cfg).task
    fm = task.foundation_model()
    assert fm is task.foundation_model()
    n_bases = len(fmod._SHARED)
    other = build(cfg).task.foundation_model()
    assert other.bundle is fm.bundle and len(fmod._SHARED) == n_bases
    fm.add_adapter("private", seed=1)
    randomize(fm, "private", 2)
    kept = fm.get_adapter("private")
    model = task.build_model(seed=0)  # FedIT's path: re-initialises only "default"
    assert model is fm.model and other.has_adapter("private")
    assert fm.active == ["default"] and fm.trainable == ["default"]
    assert all(torch.equal(kept[k], fm.get_adapter("private")[k]) for k in kept)


def test_bad_adapter_names_and_tasks_without_an_llm_name_the_field(tmp_path) -> None:
    fm = tiny_fm()
    with pytest.raises(UnknownNameError, match=r"lora\.adapter.*'nope'"):
        fm.get_adapter("nope")
    fm.add_adapter("a", seed=0)
    with (
        pytest.raises(UnknownNameError, match=r"lora\.adapter.*'nope' \(have a\)"),
        fm.use(["a", "nope"]),
    ):
        pass
    assert fm.active == []  # a refused choice changes nothing
    with pytest.raises(ConfigError, match=r"lora\.trainable"):
        fm.set_active([], ["a"])
    with pytest.raises(ConfigError, match=r"lora\.adapters"):
        fm.add_adapter("a", seed=0)
    from helpers import toy  # noqa: F401

    task = build(load_config({"task": {"kind": "toy"}, "out_dir": str(tmp_path)})).task
    with pytest.raises(ConfigError, match=r"task\.kind: task 'toy' has no foundation model"):
        capable(task, HasFoundationModel).foundation_model()


# ---------------------------------------------------------------------------------------------
# Generation

PROMPTS = [
    "What is the capital of France?",
    "Hi",
    "A farmer has 12 apples and gives away 5. How many are left? Explain step by step.",
    "Summarize the following text in one sentence.",
    "Name a planet.",
]


def test_greedy_generation_equals_bare_generate_and_is_batch_invariant() -> None:
    fm = tiny_fm()
    fm.add_adapter("global", seed=1)
    randomize(fm, "global", 2, scale=0.5)
    prompts = [fm.instruction_prompt(p) for p in PROMPTS]
    batched = fm.generate(prompts, ["global"], seed=0, max_new_tokens=6, batch_size=4)
    single = fm.generate(prompts, ["global"], seed=0, max_new_tokens=6, batch_size=1)
    assert batched == single and len(set(batched)) > 1
    base = fm.generate(prompts, [], seed=0, max_new_tokens=6)
    assert base != batched  # the adapter set is honoured
    # The same text as a bare transformers generate call on one prompt with the adapter on.
    tok = fm.tokenizer
    ids = torch.tensor([tok(prompts[2], add_special_tokens=False)["input_ids"]])
    with fm.use(["global"]) as model, torch.no_grad():
        mask = torch.ones_like(ids)  # pad = eos = <|im_end|> also closes the system turn
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert batched[2] == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_sampling_is_seeded_without_the_global_rng() -> None:
    fm = tiny_fm()
    prompts = [fm.instruction_prompt(p) for p in PROMPTS]
    kw = {"do_sample": True, "temperature": 1.0, "top_p": 0.95, "max_new_tokens": 8}
    torch.manual_seed(1)
    state = torch.get_rng_state()
    first = fm.generate(prompts, [], seed=11, **kw)
    assert torch.equal(torch.get_rng_state(), state)  # neither used nor advanced
    torch.manual_seed(2)  # a different global history changes nothing
    assert fm.generate(prompts, [], seed=11, **kw) == first
    other = fm.generate(prompts, [], seed=12, **kw)
    assert other != first
    assert fm.generate(prompts, [], seed=11, max_new_tokens=8) != first  # greedy is not sampled


def test_each_row_stops_at_its_own_end_of_turn() -> None:
    from fedfm.models.generation import generate
    from helpers.models import bigram_llama

    tok = small_tokenizer()
    ids = tok("\nyes 7", add_special_tokens=False)["input_ids"]
    model = bigram_llama(tok, [*ids, tok.eos_token_id])  # "\n" -> "yes" -> " 7" -> eos
    # One prompt ends right before " 7" and stops after one token; the other needs three.
    rows = [[5, ids[-2]], [5, ids[0]]]
    assert generate(model, tok, rows, max_new_tokens=8, batch_size=2) == ["7", "yes 7"]


def test_prompt_template_keeps_its_tail_and_cuts_the_reference_in_the_middle() -> None:
    fm = tiny_fm(prompt=PromptConfig(max_prompt_length=160))
    template = (
        "### Instruction:\n{instruction}\n\n### Reference Answer:\n{reference}\n\n### Response:\n"
    )
    reference = " ".join(f"word{i}" for i in range(200))
    fields = {"instruction": "Add two and three.", "reference": reference}
    system = "Using the reference answer as a guide, write your own response."
    text = fm.prompt(template, fields, system=system, cut=("reference", "instruction"))
    ids = fm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert 150 <= len(ids) <= 160
    assert text.endswith("### Response:\n<|im_end|>\n<|im_start|>assistant\n")
    assert "Add two and three." in text  # the instruction was not needed to fit
    assert "word0 word1 word2" in text and "word198 word199" in text  # head and tail
    assert text.count(" ... ") == 1 and "word100 " not in text  # the middle is gone
    short = fm.prompt(template, {"instruction": "Hi", "reference": "Hello"}, system=system)
    assert "### Reference Answer:\nHello\n\n### Response:\n" in short
    with pytest.raises(ConfigError, match=r"prompt\.max_prompt_length"):
        fm.prompt(template, {**fields, "instruction": reference}, cut=("reference",))
    with pytest.raises(ConfigError, match=r"generate\.temperature"):
        fm.generate(["x"], [], seed=0, temperature=0)


# ---------------------------------------------------------------------------------------------
# All-layer features

TEXTS = ["Hi", "What is the capital of France?", "one two three four five six seven", "x y"]


def test_all_layer_features_match_the_full_model_and_batch_size_one() -> None:
    fm = tiny_fm()
    fm.add_adapter("global", seed=1)
    randomize(fm, "global", 2, scale=0.5)
    feats = fm.features(TEXTS, ["global"], batch_size=3)  # two padded batches
    assert feats.shape == (4, fm.num_layers + 1, fm.hidden_size) == (4, 3, 32)
    assert feats.dtype == torch.float32
    one = torch.cat([fm.features([t], ["global"], batch_size=1) for t in TEXTS])
    assert torch.allclose(feats, one, atol=1e-3)
    # Each row's last token in the full model's hidden states (embeddings first, final norm last).
    ids = fm.tokenizer(TEXTS[1], add_special_tokens=False)["input_ids"]
    with fm.use(["global"]) as model, torch.no_grad():
        states = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    expected = torch.stack([s[0, -1] for s in states])  # (3, 32)
    assert torch.allclose(feats[1], expected, atol=1e-5)
    # The adapter set is honoured; layers can be chosen, negative from the end.
    base = fm.features(TEXTS, [])
    assert torch.allclose(base[:, 0], feats[:, 0])  # embeddings carry no LoRA here
    assert not torch.allclose(base[:, 2], feats[:, 2], atol=1e-4)
    picked = fm.features(TEXTS, ["global"], layers=[0, -1], batch_size=3)  # the same batches
    assert torch.allclose(picked, feats[:, [0, 2]], atol=1e-6)
    mean = fm.features(TEXTS[1:2], [], layers=[1], pool="mean")
    with torch.no_grad():
        full = fm.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert torch.allclose(mean[0, 0], full[1][0].mean(0), atol=1e-5)


def test_features_never_compute_the_lm_head_and_check_layer_indices() -> None:
    fm = tiny_fm()

    def refuse(*_: Any) -> None:
        raise AssertionError("the LM head was computed")

    handle = fm.bundle.model.lm_head.register_forward_pre_hook(refuse)
    try:
        assert fm.features(TEXTS, []).shape == (4, 3, 32)
    finally:
        handle.remove()
    for bad in ([3], [-4]):
        with pytest.raises(ConfigError, match=r"features\.layers: layer -?\d is out of range"):
            fm.features(TEXTS, [], layers=bad)


def test_a_separate_small_feature_model_is_an_encoder_like_the_llm() -> None:
    from fedfm.models.encoders import load_encoder

    small = load_encoder("tiny-llama", hidden=16, layers=3, heads=2, seed=3)
    fm = tiny_fm()
    for model in (small, fm.feature_view([])):
        feats = model.layer_features(TEXTS, batch_size=2)
        assert feats.shape == (len(TEXTS), model.num_layers + 1, model.dim)
        # The encoder's vector is the last token's final hidden state.
        torch.testing.assert_close(model.encode(TEXTS), feats[:, -1], rtol=0, atol=1e-6)
    assert small.layer_features(TEXTS).shape == (4, 4, 16)
    base = small.stack().backbone  # the process's shared base of that model
    assert not base.training  # frozen, in eval mode
    assert not any(p.requires_grad for p in base.parameters())


@pytest.mark.slow
def test_minilm_all_layer_features() -> None:
    from fedfm.models.encoders import load_encoder

    minilm = load_encoder("all-minilm-l6-v2")
    feats = minilm.layer_features(TEXTS, batch_size=3, pool="mean")
    assert feats.shape == (4, 7, 384)
    one = torch.cat([minilm.layer_features([t], pool="mean") for t in TEXTS])
    assert torch.allclose(feats, one, atol=1e-3)
    last = minilm.layer_features(TEXTS, layers=[-1], batch_size=4)
    assert torch.allclose(
        last, torch.cat([minilm.layer_features([t], layers=[6]) for t in TEXTS]), atol=1e-3
    )


# ---------------------------------------------------------------------------------------------
# Instruction data helpers and per-item evaluation


DOMAINS = ["general", "math", "spam"]


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cfg = load_config(
        {
            "name": "items",
            "out_dir": str(tmp_path_factory.mktemp("items")),
            "task": tiny_task(
                {"vocab": "small", "hidden": 32, "layers": 1, "heads": 2, "seed": 5},
                source_options={"per_domain_train": 6, "per_domain_test": 2, "domains": DOMAINS},
                max_new_tokens=3,
                eval_ppl=False,
            ),
        }
    )
    return build(cfg).task


def test_subset_by_id_and_replaced_outputs_keep_the_raw_ones(task) -> None:
    data = task.client_data("0")
    ids = data.ids()
    sub = data.subset([str(ids[3]), ids[1]])
    assert sub.ids() == [ids[1], ids[3]]  # the data's order, ints or strings alike
    with pytest.raises(FedfmError, match=r"ids \['-1'\] are not rows"):
        data.subset([-1])
    rewritten = data.with_outputs({ids[0]: "A new answer.", str(ids[2]): "Another one."})
    assert rewritten.rows["output"][0] == "A new answer."
    assert rewritten.rows["output"][1] == data.rows["output"][1]  # not named: unchanged
    assert rewritten.rows["output_raw"] == data.rows["output"]
    again = rewritten.with_outputs({ids[0]: "Third."})
    assert again.rows["output_raw"] == data.rows["output"]  # still the source's answers
    assert data.rows["output"][0] != "A new answer."  # the client's own data is untouched
    # Training batches use the new answers: the response labels decode to them.
    row = task.encode(rewritten)[0]
    labels = [t for t in row["labels"] if t != -100]
    assert task.tokenizer.decode(labels).startswith("A new answer.")


def test_evaluation_items_carry_prompt_reference_answer_and_score(task) -> None:
    model = task.build_model(seed=0)
    metrics, items = task.evaluate_items(model, task.test_data())
    assert metrics == task.evaluate(model, task.test_data())
    assert len(items) == metrics["n"] == len(task.test_data())
    keys = {"id", "domain", "metric", "prompt", "reference", "answer", "score", "zeroshot"}
    keys |= {"truncated"}  # whether the answer hit its token budget
    for item in items:  # a classification item also names the label it predicted
        assert set(item) == keys | ({"label"} if item["metric"] == "acc" else set())
    for domain in ("general", "math", "spam"):
        scores = [i["score"] for i in items if i["domain"] == domain]
        assert metrics[f"score/{domain}"] == pytest.approx(sum(scores) / len(scores))
    math = next(i for i in items if i["domain"] == "math")
    assert math["metric"] == "gsm8k_acc" and math["reference"].strip().isdigit()
    assert math["prompt"].endswith("<|im_start|>assistant\n")


def test_head_to_head_win_rate_by_hand() -> None:
    from fedfm.eval.llm import head_to_head

    a = [
        {"id": 1, "domain": "x", "score": 1.0},
        {"id": 2, "domain": "x", "score": 0.5},
        {"id": 3, "domain": "y", "score": 0.2},
        {"id": 4, "domain": "y", "score": 0.9},  # not in b: ignored
    ]
    b = [
        {"id": 1, "domain": "x", "score": 0.0},  # win
        {"id": 2, "domain": "x", "score": 0.5},  # tie
        {"id": 3, "domain": "y", "score": 0.7},  # loss
    ]
    out = head_to_head(a, b)
    assert (out["wins"], out["ties"], out["losses"], out["n"]) == (1, 1, 1, 3)
    assert out["win_rate"] == pytest.approx(0.5)
    assert out["win_rate/x"] == pytest.approx(0.75) and out["win_rate/y"] == 0.0
    assert head_to_head(a, a)["win_rate"] == 0.5
    assert head_to_head(a, b, tie=0.6)["ties"] == 2  # |0.2 - 0.7| <= 0.6; |1 - 0| is not


def test_adapters_made_inside_a_no_grad_handler_can_be_trained_later() -> None:
    fm = tiny_fm()
    with torch.inference_mode():  # what a MessageKind(no_grad=True) handler runs under
        fm.load_adapter("global", None, seed=0)
        fm.set_adapter("global", {k: v + 0.1 for k, v in fm.get_adapter("global").items()})
    with fm.use(["global"], ["global"]) as model:
        model(input_ids=_ids(), labels=_ids()).loss.backward()
        grads = [p.grad for n, p in model.named_parameters() if ".global." in n]
        assert grads and all(g is not None for g in grads)
        model.zero_grad(set_to_none=True)
