"""The engine: runs a strategy's schedule (``plan``) over a transport (``executor``),
matching arriving messages to receives (``matching``), over chunks and segments of the data
(``layout``)."""
