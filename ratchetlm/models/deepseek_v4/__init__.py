"""DeepSeek-V4: SWA/CSA/HCA attention with a paged, commit-exact decode cache.

See docs/deepseek_v4.md for the cache contract and where HF and DeepSeek's code differ.
"""
