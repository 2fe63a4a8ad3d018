"""A tiny Hugging Face GPT-2 with a real tokenizer of its own, as a model from the Hub comes, for the tests of text.

The tokenizer is a byte-level BPE (GPT-2's kind) trained here with ``tokenizers`` on the text below (nothing is
downloaded) and saved beside the model; `converted_gpt2` converts both with ``zinfjax convert``, which keeps the
tokenizer beside the converted model.
"""

import contextlib
import io
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every tokenizer here is local: a download attempt is a bug

import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from zinfjax.cli import main  # noqa: E402

EOS = "<|endoftext|>"
TEXT = "\n".join(
    f"Line {i}: the layer streams from disk,  tile after tile.\n\n    indented {i * 7} ünïcode — done."
    for i in range(60)) + "\n"
DOCS = [f"Document {i} says: zinfjax fine-tunes {'adapters' if i % 2 else 'layers'} on text number {i}."
        for i in range(40)]


def bpe_tokenizer(directory, vocab: int = 320):
    """A byte-level BPE (GPT-2's kind) trained on the test's text, saved as a transformers tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT, *DOCS], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(str(directory))
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def converted_gpt2(root):
    """``root/gpt2``, a tiny HF GPT-2 (2 layers of width 32, the tokenizer's vocabulary of 320) saved with its
    tokenizer, and ``root/converted``, its ``zinfjax convert`` save_dir; returns ``(converted, tokenizer)``.

    Nothing is printed, not even what a library imported on the way prints as it loads (DeepSpeed's accelerator
    warning): what the calling test reads on stdout is its own."""
    def gpt2(tok):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id))

    return _converted(root / "gpt2", root / "converted", gpt2)


def converted_llama(root):
    """``root/llama``, a tiny HF Llama (2 layers of width 64, grouped-query attention, untied head, weights of
    spread 0.2 so that greedy decoding has clear winners) saved with its BPE tokenizer, and ``root/converted``, its
    ``zinfjax convert`` save_dir; returns ``(converted, tokenizer)``. Only Llama's adapters map onto PEFT."""
    def llama(tok):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.2,
            bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id))

    return _converted(root / "llama", root / "converted", llama)


def _converted(hf, out, build):
    """The model ``build(tokenizer)`` saved in ``hf`` with a BPE tokenizer, converted into ``out`` quietly."""
    with contextlib.redirect_stdout(io.StringIO()):
        tok = bpe_tokenizer(hf)
        build(tok).save_pretrained(str(hf), safe_serialization=True)
        assert main(["convert", str(hf), str(out), "--quiet"]) == 0
    return out, tok


def adapter_run(converted, root):
    """A LoRA run (rank 4, one step) on the converted model, saved in ``root/lora``: its checkpoint holds the
    adapters alone and names the converted model as its base, beside which the tokenizer is; returns the save_dir."""
    notes, save_dir = root / "notes.txt", root / "lora"
    notes.write_text(TEXT)
    sets = [f"model={converted}", f"data={notes}", "steps=1", "batch_size=8", "seq_len=16", "lora_rank=4",
            f"save_dir={save_dir}"]
    assert quietly(["train", "--quiet", *[a for s in sets for a in ("--set", s)]]) == 0
    return save_dir


def greedy(model, ids: list[int], new: int) -> list[int]:
    """transformers' greedy ``generate`` of ``new`` tokens after ``ids`` (the reference ``zinfjax generate``'s tokens
    are held to), not stopping at an end-of-text token."""
    with torch.no_grad():
        out = model.eval().generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
    return out[0].tolist()


def quietly(argv: list[str]) -> int:
    """``zinfjax ARGV``, its summary on stdout dropped: what the calling test reads there is its own."""
    with contextlib.redirect_stdout(io.StringIO()):
        return main(argv)
