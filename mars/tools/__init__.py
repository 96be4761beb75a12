"""Agent tools: search backends (text and image) and, later, the tool registry.

- :mod:`mars.tools.text_index` -- BM25 (bm25s) over the world's text corpus, behind ``text_search``.
- :mod:`mars.tools.image_index` -- exact inner-product (faiss) search over gallery embeddings, behind
  ``image_search``.
- :mod:`mars.tools.embedders` -- image embedders (offline colour-layout descriptor; optional local HF checkpoint).
"""
