"""Offline corpora: a prompt file in, one output row per input row out, resumable, on any backend.

    source.py     the input, read line by line ('\\n' is the only separator), never all at once
    rows.py       a parsed row (`RowRequest`), a row that failed (`RowError`), a row ready to run (`RowJob`)
    simple.py     the simple JSONL / text format: {"prompt": ...} or {"token_ids": [...]} in, {"index", ...} out
    openai.py     the OpenAI Batch API format: custom_id, url, body in; custom_id, response or error out
    formats.py    which format a source is in
    prompt_file.py  every prompt of a small file at once (`specoffload plan`), parsed as a job's rows are
    prepare.py    a row's token ids (chat template), limits and per-row SamplingParams; stop strings after the run
    manifest.py   what an output was written by (input, checkpoints, engine and sampling parameters)
    output.py     the output file: locked, appended a chunk at a time and fsynced, checked and cut on resume
    chunks.py     rows grouped into chunks, the results of a chunk, in-order release, the lease book
    progress.py   rows, tokens/s, acceptance and ETA while it runs; the final summary
    job.py        the job: scan, manifest, resume, hand chunks to a backend, write in input order

The engine sees only token ids and SamplingParams: formats, errors and files stay here.
"""
