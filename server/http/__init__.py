"""The HTTP side: the Starlette app, its routes and everything that speaks HTTP.

Owns: the app factory and middleware (`app`), the context routes receive (`serving`), the OpenAI routes and schemas (`openai_api`,
`schemas`, `responses_api`, `responses_store`), the sessions API, the Anthropic Messages
route, tokenize, the OpenAPI document, request guards (`http_guard`, `jsonbody`), API keys
and tenants, Prometheus metrics, and the one mapping from engine refusals and failures to
HTTP status codes and error bodies (`errors`).
May import: `segserve.server.engine` (its client, events, published state and domain
errors), `segserve.server.chat`, `segserve.config`. Never
`segserve.bank`, `segserve.server.runner` or `segserve.server.runtime`; nothing below the
HTTP side imports this package.
"""
