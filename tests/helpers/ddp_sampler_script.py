"""Run by test_sampler.py under `accelerate launch --multi_gpu --num_processes 2` (gloo on CPU): a DDP
training loop reading a store through FeatureDataset and ChunkShuffleSampler, the sampler taking rank
and world size from the process group. Rank 0 writes what every rank read, as JSON, to argv[2]."""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from extract import ChunkShuffleSampler, FeatureDataset

store, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
dataset = FeatureDataset(store, "feat", cache_chunks=2)
sampler = ChunkShuffleSampler(len(dataset), dataset.chunk_size, batch_size=5, window=2, seed=3)  # rank from the group
loader = DataLoader(dataset, batch_sampler=sampler, num_workers=0)
torch.manual_seed(0)
model = DistributedDataParallel(nn.Linear(dataset[0][0].numel(), 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
steps = torch.tensor(len(sampler))
dist.all_reduce(steps, op=dist.ReduceOp.MIN)  # ranks' batch counts may differ: stop together
seen = {}
for epoch in range(2):
    sampler.set_epoch(epoch)
    indices = [i for batch in sampler for i in batch]
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    seen[epoch] = indices
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, {"rank": rank, "world_size": sampler.world_size, "seen": seen, "len": len(sampler)})
# DDP keeps the replicas identical: the same weights on every rank after training
weights = [torch.zeros_like(model.module.weight) for _ in range(dist.get_world_size())]
dist.all_gather(weights, model.module.weight.detach())
if rank == 0:
    same = all(torch.equal(w, weights[0]) for w in weights)
    json.dump({"ranks": gathered, "same_weights": same}, open(out, "w"))
# both ranks tear gloo down together: a rank that destroyed its group while the other still held its
# connections was once aborted by gloo ("terminate called without an active exception", SIGABRT)
dist.barrier()
dist.destroy_process_group()
