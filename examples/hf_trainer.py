"""A Hugging Face Trainer script, federated with fedfm (FedAvg over a LoRA adapter).

Everything below is ordinary transformers/peft code: a model with a LoRA adapter, a
tokenised data set per client, a collator and TrainingArguments. fedfm runs it as each
client's local step and owns the rounds, sampling, aggregation, audit and report:

    fedfm run examples/hf_trainer.yaml                           # SmolLM2, a few minutes
    fedfm run examples/hf_trainer.yaml task.options.size=tiny    # a tiny random model

Data: fedfm's offline instruction suite, one client per domain (movie reviews, drug reviews,
question types), formatted with the model's chat template; the loss is on every token.
"""

from __future__ import annotations

import warnings

import peft
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    LlamaConfig,
    LlamaForCausalLM,
    TrainingArguments,
)

from fedfm.data.instruct import build_suite
from fedfm.integrations.hf import TrainerSetup
from fedfm.models.causal_lm import small_tokenizer, smollm2_dir

DOMAINS = ["medical", "movie", "qtype"]


def _model_and_tokenizer(size: str) -> tuple[torch.nn.Module, object]:
    if size == "smollm2":  # the offline SmolLM2-135M-Instruct as a Hugging Face folder
        folder = smollm2_dir()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:  # a tiny random Llama with a ~1k-token tokenizer (seconds on a CPU)
        tokenizer = small_tokenizer()
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            pad_token_id=tokenizer.pad_token_id,
        )
        model = LlamaForCausalLM(config)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    lora = peft.LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # peft 0.21 reads an alias transformers 5 deprecates
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(model, lora), tokenizer


def _tokenised(rows, tokenizer, max_length: int):
    def encode(row):
        chat = [
            {"role": "user", "content": f"{row['instruction']}\n{row['input']}".strip()},
            {"role": "assistant", "content": row["output"]},
        ]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        return tokenizer(text, truncation=True, max_length=max_length)

    return rows.map(encode, remove_columns=rows.column_names)


def federated(size: str = "smollm2", per_domain: int = 24, max_length: int = 128) -> TrainerSetup:
    """The model, each client's data, the collator and the training arguments."""
    model, tokenizer = _model_and_tokenizer(size)
    train, test = build_suite(per_domain, 8, seed=0, domains=DOMAINS)
    clients = {
        d: _tokenised(train.filter(lambda r, d=d: r["domain"] == d), tokenizer, max_length)
        for d in DOMAINS
    }
    args = TrainingArguments(
        output_dir="unused",  # fedfm gives each local step its own temporary folder
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=5e-4,
        optim="adamw_torch",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        use_cpu=not torch.cuda.is_available(),
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return TrainerSetup(model, clients, _tokenised(test, tokenizer, max_length), args, collator)
