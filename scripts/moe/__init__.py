"""Building MoE checkpoints from a dense one (``python -m scripts.make_moe``).

calibration   stdlib source as calibration text; a layer-major dense pass yielding each FFN's input
kmeans        spherical and balanced (equal-size) k-means in torch
shards        streamed safetensors shards + model.safetensors.index.json, provenance.json
formats       Qwen2-MoE / Mixtral config and tensor names for a dense source
upcycle       sparse upcycling: every expert is the dense FFN, k-means router (Komatsuzaki et al. 2022)
moefy         FFN neurons split into a shared + routed experts (MoEfication, Zhang et al. 2022)
measure       top-1 agreement with the dense model, expert hotness, greedy identity
"""
