"""One model call over many rows: the slab KV store, ragged and bucketed forwards, chunked prefill."""
