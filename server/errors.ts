/**
 * errors.ts — errors of the HTTP APIs and their wire shapes (OpenAI, Anthropic, Ollama).
 *
 * Owns: ApiError (an HTTP status plus a neutral kind, a message, the offending field and an
 * optional Retry-After), rendering it in each API's JSON shape, and which API a path speaks when
 * an error has no handler of its own (an unknown route, a method not allowed). A handler throws
 * one ApiError; the route decides the dialect.
 * Does not own: request parsing (openai.ts, anthropic.ts, ollama.ts) or routing (app.ts).
 */

export type Dialect = "openai" | "anthropic" | "ollama";

/** neutral kind -> [HTTP status, OpenAI error type, Anthropic error type] */
const KINDS = {
  invalid_request: [400, "invalid_request_error", "invalid_request_error"],
  authentication: [401, "authentication_error", "authentication_error"],
  forbidden: [403, "invalid_request_error", "permission_error"],
  not_found: [404, "invalid_request_error", "not_found_error"],
  model_not_found: [404, "invalid_request_error", "not_found_error"],
  method_not_allowed: [405, "invalid_request_error", "invalid_request_error"],
  request_timeout: [408, "invalid_request_error", "invalid_request_error"],
  too_large: [413, "invalid_request_error", "request_too_large"],
  rate_limit: [429, "rate_limit_error", "rate_limit_error"],
  server: [500, "server_error", "api_error"],
  unavailable: [503, "server_error", "overloaded_error"],
} as const satisfies Record<string, readonly [number, string, string]>;

type ErrorKind = keyof typeof KINDS;

/** OpenAI puts a machine-readable code next to the type for some errors. */
const OPENAI_CODES: Partial<Record<ErrorKind, string>> = {
  model_not_found: "model_not_found",
  too_large: "request_too_large",
  rate_limit: "rate_limit_exceeded",
  authentication: "invalid_api_key",
  not_found: "not_found",
  forbidden: "forbidden",
  request_timeout: "request_timeout",
};

/** Seconds a client should wait before retrying a 429 or a 503 while loading. */
export const RETRY_AFTER_S = 2;

/** An error answered to the client. */
export class ApiError extends Error {
  constructor(readonly kind: ErrorKind, message: string, readonly param: string | null = null, readonly retryAfter: number | null = null) {
    super(message);
    this.name = "ApiError";
  }

  get status(): number {
    return KINDS[this.kind][0];
  }

  headers(): Record<string, string> {
    return this.retryAfter !== null ? { "retry-after": String(this.retryAfter) } : {};
  }
}

/** A 400 naming the offending field. */
export function invalid(message: string, param: string | null = null): ApiError {
  return new ApiError("invalid_request", message, param);
}

export function openaiErrorBody(error: ApiError): Record<string, unknown> {
  return { error: { message: error.message, type: KINDS[error.kind][1], param: error.param, code: OPENAI_CODES[error.kind] ?? null } };
}

export function anthropicErrorBody(error: ApiError): Record<string, unknown> {
  return { type: "error", error: { type: KINDS[error.kind][2], message: error.message } };
}

/** Ollama's shape: {"error": "message"} (the status carries the kind). */
export function ollamaErrorBody(error: ApiError): Record<string, unknown> {
  return { error: error.message };
}

export function errorBody(dialect: Dialect, error: ApiError): Record<string, unknown> {
  switch (dialect) {
    case "openai":
      return openaiErrorBody(error);
    case "anthropic":
      return anthropicErrorBody(error);
    case "ollama":
      return ollamaErrorBody(error);
  }
}

/** The API a path belongs to, for errors no handler rendered (404, 405, 413 before routing). */
export function dialectOfPath(path: string): Dialect {
  if (path === "/v1/messages" || path.startsWith("/v1/messages/")) return "anthropic";
  if (path === "/api" || path.startsWith("/api/")) return "ollama";
  return "openai";
}
