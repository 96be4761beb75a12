"""The agent's tools and the search backends behind them.

- :mod:`~mars.tools.base`: ``Observation`` and the OpenAI-format tool schemas;
- :mod:`~mars.tools.toolbox`: ``ToolBox`` (image_zoom_in, image_search, text_search; never raises);
- :mod:`~mars.tools.cache`: content-addressed record/replay cache of tool results;
- :mod:`~mars.tools.service`: the FastAPI tool server (``mars serve-tools``) and its httpx client;
- :mod:`~mars.tools.text_index` / :mod:`~mars.tools.image_index` / :mod:`~mars.tools.embedders`:
  BM25 text search and faiss image search over the offline world;
- :mod:`~mars.tools.imaging`: Qwen-VL's ``smart_resize``.
"""
