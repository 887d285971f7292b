"""Tokenizer: BOS/EOS rules, chat templates, and agreement with the fixture tokenizers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors

from engine.chat_template import FALLBACK_CHAT_TEMPLATE, TemplateError, load_chat_template, render_chat_template
from engine.errors import ConfigError, ModelLoadError
from engine.tokenizer import Tokenizer

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<eot>"]


def tiny_byte_tokenizer(post_processor_bos: bool = False) -> HFTokenizer:
    """A byte-level BPE with no merges: one token per UTF-8 byte, plus a few special tokens.

    Multibyte characters span several tokens, which is what the streaming tests need."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS + alphabet)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    if post_processor_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def write_model_dir(path: Path, tokenizer_config: dict, generation_config: dict | None = None,
                    config: dict | None = None, post_processor_bos: bool = False) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tiny_byte_tokenizer(post_processor_bos).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    (path / "config.json").write_text(json.dumps(config or {"model_type": "qwen2"}))
    return path


def test_bos_follows_add_bos_token(tmp_path):
    on = Tokenizer.from_dir(write_model_dir(tmp_path / "on", {"bos_token": "<s>", "add_bos_token": True}))
    off = Tokenizer.from_dir(write_model_dir(tmp_path / "off", {"bos_token": "<s>", "add_bos_token": False},
                                             config={"model_type": "llama"}))
    assert on.bos_id == 0 and on.add_bos
    assert on.encode("hi")[0] == 0 and on.encode("hi")[1:] == off.encode("hi")
    assert not off.add_bos and 0 not in off.encode("hi")
    assert on.encode("hi", add_bos=False) == off.encode("hi")


def test_bos_by_llama_convention_or_post_processor(tmp_path):
    llama = Tokenizer.from_dir(write_model_dir(tmp_path / "l", {"bos_token": "<s>"}, config={"model_type": "llama"}))
    qwen = Tokenizer.from_dir(write_model_dir(tmp_path / "q", {"bos_token": "<s>"}, config={"model_type": "qwen2"}))
    post = Tokenizer.from_dir(write_model_dir(tmp_path / "p", {"bos_token": "<s>"}, post_processor_bos=True))
    assert llama.add_bos and not qwen.add_bos and post.add_bos
    # BOS is added exactly once even when the post-processor would add one too.
    assert post.encode("ab") == [0] + qwen.encode("ab")


def test_eos_is_union_of_generation_config_and_tokenizer(tmp_path):
    tok = Tokenizer.from_dir(write_model_dir(tmp_path / "a", {"eos_token": "</s>"}, {"eos_token_id": [3, 4]}))
    assert tok.eos_ids == {1, 3, 4}
    single = Tokenizer.from_dir(write_model_dir(tmp_path / "b", {"eos_token": "</s>"}, {"eos_token_id": 4}))
    assert single.eos_ids == {1, 4}
    from_config = Tokenizer.from_dir(write_model_dir(tmp_path / "c", {}, None, {"model_type": "qwen2", "eos_token_id": 3}))
    assert from_config.eos_ids == {3}


def test_special_token_text_becomes_one_token_and_decode_skips_it(tmp_path):
    tok = Tokenizer.from_dir(write_model_dir(tmp_path, {}))
    ids = tok.encode("<|im_start|>hé")
    assert ids[0] == 2 and len(ids) == 1 + 3  # 'h' + two bytes of 'é'
    assert tok.decode(ids) == "hé"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hé"


def test_chat_template_from_config_with_hf_whitespace_rules(tmp_path):
    template = ("{% for m in messages %}\n    <{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}\n"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = Tokenizer.from_dir(write_model_dir(tmp_path, {"chat_template": template, "bos_token": "<s>"}))
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    # trim_blocks drops the newline after a block tag; lstrip_blocks drops the indentation before it.
    assert out == "    <user>hi\n<assistant>"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "    <user>hi\n"


def test_chat_template_jinja_file_wins_and_named_templates(tmp_path):
    d = write_model_dir(tmp_path, {"chat_template": [{"name": "tool_use", "template": "T"},
                                                     {"name": "default", "template": "D{{ bos_token }}"}],
                                   "bos_token": "<s>"})
    assert Tokenizer.from_dir(d).apply_chat_template([]) == "D<s>"
    (d / "chat_template.jinja").write_text("J{{ messages|length }}")
    assert load_chat_template(d, {}) == "J{{ messages|length }}"
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "J1"


def test_template_helpers_and_errors():
    assert render_chat_template("{{ strftime_now('%Y') | length }}", []) == "4"
    assert render_chat_template("{{ {'a': 'é'} | tojson }}", []) == '{"a": "é"}'
    with pytest.raises(TemplateError, match="only user"):
        render_chat_template("{{ raise_exception('only user and assistant roles') }}", [])
    with pytest.raises(ConfigError):
        render_chat_template("{% for %}", [])
    # The sandbox refuses access to Python internals from a downloaded template.
    with pytest.raises(ConfigError):
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])


def test_fallback_template_when_model_has_none(tmp_path):
    tok = Tokenizer.from_dir(write_model_dir(tmp_path, {}))
    assert tok.chat_template is None
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == render_chat_template(FALLBACK_CHAT_TEMPLATE, [{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_encode_chat_does_not_double_bos(tmp_path):
    tok = Tokenizer.from_dir(write_model_dir(tmp_path, {"bos_token": "<s>", "add_bos_token": True,
                                                        "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}"}))
    ids = tok.encode_chat([{"role": "user", "content": "a"}])
    assert ids.count(0) == 1 and ids[0] == 0


def test_missing_and_bad_files_raise_one_line_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    d = write_model_dir(tmp_path / "bad", {})
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="cannot be read"):
        Tokenizer.from_dir(d)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fixture_tokenizers(ref_fixtures, arch):
    manifest = json.loads((ref_fixtures / "manifest.json").read_text())
    tok = Tokenizer.from_dir(ref_fixtures / "hf" / arch)
    assert tok.bos_id == 0 and tok.eos_ids == {1}
    ids = tok.encode(manifest["prompt"], add_bos=True)
    tags = [t for t, m in manifest["models"].items() if m["source"] == f"hf/{arch}"]
    for tag in tags:
        assert ids == manifest["models"][tag]["prompt_ids"]
    assert tok.decode(ids) == manifest["prompt"]
    # Llama convention adds BOS by default; Qwen2 does not.
    assert tok.add_bos == (arch == "llama")
    chat = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert tok.decode(chat, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
