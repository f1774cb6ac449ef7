"""A follower in a process of its own (a process group's name is process-wide, so rank 0 and a member cannot share
one): ``python follower_peer.py MODEL_DIR``; prints its URL, serves until stdin closes."""

import sys

import torch
from transformers import AutoModelForCausalLM

from relax_hpc.weights.follower import Follower

if __name__ == "__main__":
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    f = Follower({n: t.detach().clone() for n, t in model.state_dict().items()}, "0")
    print(f.serve("127.0.0.1", api_key=None), flush=True)
    sys.stdin.read()
    f.close()
