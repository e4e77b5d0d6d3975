"""Multi-adapter LoRA helpers on a tiny random Llama."""

from __future__ import annotations

import pydantic
import pytest
import torch
from peft import PeftModel

from fedfm.core.groups import get_group
from fedfm.data.prompt import PromptConfig, chat_prompt
from fedfm.errors import AssetMissingError, ConfigError, UnknownNameError
from fedfm.models.causal_lm import small_tokenizer, tiny_llama
from fedfm.models.generation import generate
from fedfm.models.lora import (
    AdapterStateError,
    LoraConfigSpec,
    active_adapters,
    adapter_param_names,
    adapter_tensors,
    add_adapters,
    get_adapter_state,
    load_adapter,
    named_adapter_keys,
    save_adapter,
    set_active,
    set_adapter_state,
    trainable_state,
)

SPEC = LoraConfigSpec(r=4, alpha=8, dropout=0.0)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def _inputs() -> torch.Tensor:
    return torch.randint(3, 800, (2, 7), generator=torch.Generator().manual_seed(1))  # (2, 7)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_inputs()).logits  # (2, 7, vocab)


def _randomize_b(model: torch.nn.Module, name: str, seed: int) -> None:
    """Gives adapter ``name`` non-zero B matrices so that it changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if f"lora_B.{name}." in key:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))


def _two_adapters() -> PeftModel:
    model = add_adapters(tiny_llama(seed=0).model, ["first", "second"], SPEC, seed=0)
    _randomize_b(model, "first", 1)
    _randomize_b(model, "second", 2)
    return model


def test_zero_b_equals_base_exactly_and_random_b_differs() -> None:
    base = tiny_llama(seed=0).model
    expected = _logits(base)
    model = add_adapters(base, ["first", "second"], LoraConfigSpec(), seed=0)
    assert active_adapters(model) == ["first", "second"]
    assert torch.equal(_logits(model), expected)
    _randomize_b(model, "first", 1)
    assert not torch.allclose(_logits(model), expected, atol=1e-4)
    set_active(model, [], [])
    assert torch.equal(_logits(model), expected)


def test_two_active_adapters_add_their_deltas_on_a_layer() -> None:
    model = _two_adapters()
    set_active(model, ["first", "second"], [])
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))  # (3, in)
    scale = SPEC.alpha / SPEC.r  # 2.0
    w0 = layer.base_layer.weight  # (out, in)
    expected = x @ w0.T
    for name in ("first", "second"):
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight  # (r, in), (out, r)
        expected = expected + scale * (x @ a.T @ b.T)
    with torch.no_grad():
        assert torch.allclose(layer(x), expected, atol=1e-6)
    # Whole model: both together differ from each one alone.
    both = _logits(model)
    set_active(model, ["first"], [])
    first = _logits(model)
    set_active(model, ["second"], [])
    second = _logits(model)
    assert not torch.allclose(both, first, atol=1e-4)
    assert not torch.allclose(both, second, atol=1e-4)
    # peft generates with a list of active adapters.
    set_active(model, ["first", "second"], [])
    tok = small_tokenizer()
    prompts = [chat_prompt(tok, p, None, PromptConfig()) for p in ["hi", "hello there"]]
    replies = generate(model, tok, prompts, max_new_tokens=3)
    assert len(replies) == 2


def test_only_the_trainable_adapter_changes_after_a_step() -> None:
    model = _two_adapters()
    set_active(model, ["first", "second"], trainable=["second"])
    model.train()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == 2 * 4 * 2  # layers x modules x (A, B)
    optimizer = torch.optim.SGD(params, lr=0.5)
    ids = _inputs()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    for key, param in model.named_parameters():
        if ".second." in key:
            assert not torch.equal(param, before[key]), key
        else:  # the frozen adapter and every base weight are bitwise unchanged
            assert torch.equal(param, before[key]), key
            assert param.grad is None, key


def test_set_active_refuses_unknown_and_inactive_trainable() -> None:
    model = _two_adapters()
    with pytest.raises(UnknownNameError, match="unknown adapter 'third'"):
        set_active(model, ["third"], [])
    with pytest.raises(ConfigError, match="trainable but not active"):
        set_active(model, ["first"], ["second"])
    with pytest.raises(ConfigError, match="already exists"):
        add_adapters(model, ["first"], SPEC)


def test_adapter_state_round_trip_is_independent_of_the_adapter_name() -> None:
    model = _two_adapters()
    state = get_adapter_state(model, "first")
    assert len(state) == 2 * 4 * 2
    assert all("first" not in key for key in state)
    assert all(v.device.type == "cpu" and not v.requires_grad for v in state.values())
    # A copy, not a view: changing the model afterwards leaves the state alone.
    key = next(k for k in state if ".lora_B." in k)
    snapshot = state[key].clone()
    _randomize_b(model, "first", 9)
    assert torch.equal(state[key], snapshot)
    _randomize_b(model, "first", 1)

    set_active(model, ["first"], [])
    out_first = _logits(model)
    set_adapter_state(model, "second", state)
    assert all(torch.equal(v, state[k]) for k, v in get_adapter_state(model, "second").items())
    set_active(model, ["second"], [])
    assert torch.equal(_logits(model), out_first)


def test_wrong_states_are_refused() -> None:
    model = _two_adapters()
    state = get_adapter_state(model, "first")
    bigger = get_adapter_state(
        add_adapters(tiny_llama(seed=0).model, ["x"], LoraConfigSpec(r=8)), "x"
    )
    with pytest.raises(AdapterStateError, match=r"has shape \(8, 64\), expected \(4, 64\)"):
        set_adapter_state(model, "second", bigger)
    missing = dict(list(state.items())[1:])
    with pytest.raises(AdapterStateError, match="1 missing keys"):
        set_adapter_state(model, "second", missing)
    extra = {**state, "base_model.model.lm_head.weight": torch.zeros(1)}
    with pytest.raises(AdapterStateError, match="1 unknown keys"):
        set_adapter_state(model, "second", extra)
    with pytest.raises(UnknownNameError):
        get_adapter_state(model, "nope")


def test_trainable_state_holds_only_trainable_adapters_grouped_by_name() -> None:
    model = _two_adapters()
    set_active(model, ["first", "second"], trainable=["second"])
    state = trainable_state(model)
    assert len(state) == 16
    assert set(get_group(state, "second")) == set(get_adapter_state(model, "second"))
    assert all(k.startswith("second/") and ".second." not in k for k in state)
    assert {k.split(".")[-3] for k in state} == set(MODULES)
    set_active(model, ["first", "second"], trainable=[])
    assert trainable_state(model) == {}


def test_live_adapter_tensors_and_their_parameter_names() -> None:
    model = _two_adapters()
    live = adapter_tensors(model, "second")
    assert list(live) == list(get_adapter_state(model, "second"))  # the same keys, in order
    params = dict(model.named_parameters())
    names = adapter_param_names(model, "second")
    assert all(params[names[k]] is p for k, p in live.items())  # the parameters themselves
    assert all(".lora_A.second." in n or ".lora_B.second." in n for n in names.values())
    with pytest.raises(UnknownNameError):
        adapter_tensors(model, "nope")


def test_keys_that_name_their_adapter_are_told_apart() -> None:
    model = _two_adapters()
    named = [n for n, _ in model.named_parameters() if ".lora_" in n]
    assert named_adapter_keys(named) == named  # fedfm's earlier format
    assert named_adapter_keys(["params/" + n for n in named]) == ["params/" + n for n in named]
    grouped = trainable_state(model) | {
        f"params/{k}": v for k, v in get_adapter_state(model, "first").items()
    }
    assert named_adapter_keys(grouped) == []  # peft's saved keys, grouped or not
    dora = add_adapters(tiny_llama(seed=0).model, ["d"], LoraConfigSpec(r=2, use_dora=True))
    assert named_adapter_keys(get_adapter_state(dora, "d")) == []
    assert named_adapter_keys(k for k, _ in dora.named_parameters() if "magnitude" in k)


def test_saved_adapter_loads_with_plain_peft_and_with_fedfm(tmp_path) -> None:
    model = _two_adapters()
    set_active(model, ["second"], [])
    expected = _logits(model)
    folder = save_adapter(model, "second", tmp_path / "adapter")
    assert {p.name for p in folder.iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }

    plain = PeftModel.from_pretrained(tiny_llama(seed=0).model, folder)
    assert torch.equal(_logits(plain), expected)

    # fedfm: into a new adapter name, then over an existing adapter.
    other = add_adapters(tiny_llama(seed=0).model, ["client"], SPEC)
    load_adapter(other, "loaded", folder)
    assert not any(p.requires_grad for k, p in other.named_parameters() if ".loaded." in k)
    set_active(other, ["loaded"], [])
    assert torch.equal(_logits(other), expected)
    load_adapter(other, "client", folder)
    set_active(other, ["client"], [])
    assert torch.equal(_logits(other), expected)
    with pytest.raises(AssetMissingError):
        load_adapter(other, "x", tmp_path / "nothing")


def test_lora_spec_is_validated() -> None:
    assert LoraConfigSpec().target_modules == list(MODULES)
    with pytest.raises(pydantic.ValidationError):
        LoraConfigSpec(r=0)
    with pytest.raises(pydantic.ValidationError):
        LoraConfigSpec(rank=4)
    with pytest.raises(pydantic.ValidationError):
        LoraConfigSpec(target_modules=[])
    config = LoraConfigSpec(r=2, alpha=4, dropout=0.1).to_peft("CAUSAL_LM")
    assert (config.r, config.lora_alpha, config.lora_dropout) == (2, 4, 0.1)
