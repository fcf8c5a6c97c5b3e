"""Float64 q, k, v projections of an attention layer, by hand, with kv heads repeated explicitly."""


def project_qkv(layer, x, n_kv_head):
    """layer: a QKVAttention (converted to float64 here), x [B,T,C] -> q, k [B,T,H,qk_dim], v [B,T,H,D] in float64."""
    layer = layer.double()
    x = x.double()
    B, T, C = x.shape
    H, D, Dk = layer.n_head, layer.head_dim, layer.qk_dim  # qk_dim: queries' and keys' width (Based's d')
    qkv = x @ layer.c_attn.weight.T + layer.c_attn.bias
    q, k, v = qkv.split([H * Dk, n_kv_head * Dk, n_kv_head * D], dim=-1)
    q = q.reshape(B, T, H, Dk)
    k = k.reshape(B, T, n_kv_head, Dk).repeat_interleave(H // n_kv_head, dim=2)
    v = v.reshape(B, T, n_kv_head, D).repeat_interleave(H // n_kv_head, dim=2)
    return layer, x, q, k, v
