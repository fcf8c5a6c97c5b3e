"""The delta-rule GPTs with ``backend: fla`` (flash-linear-attention's chunked kernel for whole sequences)
against the same GPTs with ``backend: torch`` (ours), on a CUDA device with fla importable.

    python3 gdn_fla.py check   # same weights: loss and every parameter's gradient; decode after an fla prefill
    python3 gdn_fla.py speed [T ...]   # training-step time (forward, backward, AdamW), fp32 and bf16 autocast
"""
import copy
import sys
import time

import torch

from lintrans.models import GPT, GPTConfig

torch.backends.cudnn.allow_tf32 = False  # the depthwise convolution in full float32 (fla's TF32 is what is measured)
torch.backends.cuda.matmul.allow_tf32 = False


def gpt(attention, backend, T, n_layer, n_head, n_embd, pos="none", seed=0):
    torch.manual_seed(seed)
    options = {"backend": backend} if backend else {}
    cfg = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=T, vocab_size=256, dropout=0.0,
                    attention=attention, attention_options=options, pos_embedding=pos)
    return GPT(cfg).cuda()


def rel(a, b):
    return (a.float() - b.float()).abs().max().item() / max(1.0, b.float().abs().max().item())


def check():
    for attention in ("deltanet", "gated-deltanet"):
        ours = gpt(attention, "torch", 512, 2, 2, 128)
        fla = gpt(attention, "fla", 512, 2, 2, 128)
        fla.load_state_dict(ours.state_dict())
        g = torch.Generator(device="cuda").manual_seed(1)
        for T in (1, 300):
            x = torch.randint(0, 256, (2, T), device="cuda", generator=g)
            losses, grads = [], []
            for m in (ours, fla):
                m.zero_grad(set_to_none=True)
                _, loss = m(x, x, return_logits=False)
                loss.backward()
                losses.append(loss.item())
                grads.append({n: p.grad for n, p in m.named_parameters()})
            worst = max((rel(grads[1][n], grads[0][n]), n) for n in grads[0])
            print(f"{attention:>15} T={T:<4} loss ours {losses[0]:.6f} fla {losses[1]:.6f} "
                  f"(diff {abs(losses[0] - losses[1]):.2e}); worst gradient {worst[1]}: {worst[0]:.2e} "
                  f"of its largest value; {'OK' if worst[0] < 2e-2 and abs(losses[0] - losses[1]) < 1e-3 else 'FAIL'}")
        m = fla.eval()
        x = torch.randint(0, 256, (2, 260), device="cuda", generator=g)
        with torch.no_grad():
            full, _ = m(x)
            logits, cache = m.forward_cached(x[:, :200])  # prefill: fla's kernel
            steps = [logits[:, -1]]
            for t in range(200, 259):  # one token at a time: our step on the state fla returned
                logits, cache = m.forward_cached(x[:, t:t + 1], cache)
                steps.append(logits[:, -1])
        err = rel(torch.stack(steps, 1), full[:, 199:259])
        print(f"{attention:>15} decode after an fla prefill (200 + 59 tokens) vs fla's full forward: "
              f"{err:.2e} of the largest logit; {'OK' if err < 2e-2 else 'FAIL'}")


def speed(*lengths):
    tokens = 16384
    print("training step (forward, backward, AdamW) ms, 4 layers, width 512, 8 heads of 64, "
          f"{tokens} tokens per step, mean of 5 after 2 warm-ups (the first autotunes fla)")
    for T in [int(t) for t in lengths] or (2048, 8192):
        for precision in ("fp32", "bf16"):
            for attention, backend, pos in (("softmax", None, "rope"), ("gated-deltanet", "torch", "none"),
                                            ("gated-deltanet", "fla", "none")):
                m = gpt(attention, backend, T, 4, 8, 512, pos)
                opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
                x = torch.randint(0, 256, (tokens // T, T), device="cuda")

                def step():
                    with torch.autocast("cuda", torch.bfloat16, enabled=precision == "bf16"):
                        _, loss = m(x, x, return_logits=False)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                t0 = time.perf_counter()
                for _ in range(2):
                    step()
                torch.cuda.synchronize()
                warm = time.perf_counter() - t0
                t0 = time.perf_counter()
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
                ms = (time.perf_counter() - t0) / 5 * 1e3
                print(f"  T={T} {precision} {attention}{'/' + backend if backend else ''}: {ms:.1f} ms "
                      f"(warm-up {warm:.1f} s)", flush=True)
                del m, opt
                torch.cuda.empty_cache()


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    {"check": check, "speed": speed}[sys.argv[1]](*sys.argv[2:])
