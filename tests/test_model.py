"""The byte-level tokenizer, its chat template, and checkpoints in Hugging Face format."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gyreflow.model import ModelConfig, build_policy, build_tokenizer, load_policy, save_policy
from gyreflow.model.chat import END_ID, generation_prompt_ids, message_ids
from gyreflow.model.tokenizer import VOCAB_SIZE


def test_ids_are_utf8_bytes_and_round_trip():
    tok = build_tokenizer()
    text = "héllo go(b) ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|end|>") == END_ID
    assert len(tok) == VOCAB_SIZE


def test_chat_template_matches_token_space_format():
    tok = build_tokenizer()
    messages = [{"role": "user", "content": "cross 2 rooms"}, {"role": "assistant", "content": "read()"},
                {"role": "tool", "content": [{"type": "text", "text": "note: a"}]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    expected = message_ids("user", "cross 2 rooms") + message_ids("assistant", "read()") + \
        message_ids("tool", "note: a") + generation_prompt_ids()
    assert list(ids) == expected


def test_checkpoint_is_plain_hugging_face(tmp_path):
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    model = build_policy(cfg, seed=1)
    save_policy(model, tmp_path)
    assert (tmp_path / "config.json").is_file() and (tmp_path / "model.safetensors").is_file()
    other = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = torch.tensor([message_ids("user", "hi")])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, other(input_ids=ids).logits)
        assert torch.allclose(model(input_ids=ids).logits, load_policy(tmp_path)(input_ids=ids).logits)
    assert tok.decode(tok("go(a)")["input_ids"]) == "go(a)"
