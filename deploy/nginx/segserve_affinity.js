// Affinity key for segserve replicas behind nginx (njs; loaded by segserve.conf).
//
// nginx hashes X-Session-Id itself; this function is the fallback for requests without the
// header. It reads the JSON body (already in memory: proxy_pass reads the whole body
// before the upstream is chosen, and client_body_buffer_size keeps it out of temp files)
// and returns, in order: the `prompt_cache_key` field, the first user message of
// /v1/chat/completions (or the first input item of /v1/responses), the start of a
// /v1/completions prompt. A client that resends its history sends the same first user
// message every turn, so every turn hashes alike and lands on the replica that holds its
// segments. Anything else (no body, a body spilled to a file, not JSON) gets the request
// id: spread evenly, no affinity.

var KEY_CHARS = 4096; // characters of a message or prompt that are hashed

function text(value) {
    if (typeof value === 'string') {
        return value;
    }
    if (value === undefined || value === null) {
        return '';
    }
    return JSON.stringify(value);
}

function firstUser(items) {
    if (!Array.isArray(items)) {
        return '';
    }
    for (var i = 0; i < items.length; i++) {
        var m = items[i];
        if (m && typeof m === 'object' && (m.role === 'user' || m.role === undefined)) {
            return text(m.content);
        }
    }
    return '';
}

function key(r) {
    var body;
    try {
        body = JSON.parse(r.requestText);
    } catch (e) {
        return 'request:' + r.variables.request_id;
    }
    if (!body || typeof body !== 'object') {
        return 'request:' + r.variables.request_id;
    }
    if (typeof body.prompt_cache_key === 'string' && body.prompt_cache_key.length > 0) {
        return 'session:' + body.prompt_cache_key;
    }
    var first = firstUser(body.messages) || firstUser(body.input);
    if (!first && typeof body.input === 'string') {
        first = body.input;
    }
    if (!first && body.prompt !== undefined) {
        first = text(body.prompt);
    }
    return first ? 'first-user:' + first.substring(0, KEY_CHARS) : 'request:' + r.variables.request_id;
}

export default { key };
