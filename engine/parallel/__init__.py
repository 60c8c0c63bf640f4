"""Tensor parallelism (Megatron-style) of the Llama family: one process per rank.

plan.py       which heads, intermediate columns and vocabulary rows each rank holds (no torch)
group.py      the torch.distributed process group (gloo on the CPU, NCCL on CUDA) and its collectives
model.py      the sharded model: column-parallel qkv and gate/up, row-parallel o and down (one
              all-reduce each per layer), vocabulary-parallel embedding and LM head
weights.py    each rank's slices of a safetensors (memory-mapped) or GGUF checkpoint
messages.py   the step broadcast: one message per model call, rank 0 -> workers
worker.py     a worker rank's process: load its shard, then execute what rank 0 sends
driver.py     rank 0: start the workers, mirror each model call to them, watch them die
"""
