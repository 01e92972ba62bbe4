"""Layers of the hybrid model: norms, RoPE, causal conv, GDN mixer, gated attention, MLP / MoE."""
