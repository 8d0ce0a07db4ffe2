/**
 * app.ts — the koa app: the web chat page's paths, then every row of the route table
 * (routes.ts), each run through the shared request steps (steps.ts), then the answer for a
 * request no route takes.
 *
 * Owns: assembling the app, and the default model id. Does not own: the routes (routes.ts), the
 * request steps, errors and the log line (steps.ts), the web chat page (web.ts), binding and
 * signals (serve.ts).
 */
import Router from "@koa/router";
import Koa from "koa";

import type { ExpertDtype } from "../host/pack/pack-format.js";
import type { EngineQueue } from "./queue.js";
import { ROUTES } from "./routes.js";
import { RequestSteps, type ServerConfig } from "./steps.js";
import { WebPage } from "./web.js";

export type { ServerConfig } from "./steps.js";

export const DEFAULT_MODEL_ID = "kimi-vl-a3b-instruct-q8";

/** The id served when --model-id is not given: it names what the routed experts are stored as
 * (most of the weights), so a Q4 pack never calls itself Q8. */
export function defaultModelId(expertDtype: ExpertDtype): string {
  return `kimi-vl-a3b-instruct-${expertDtype}`;
}

export function createApp(queue: EngineQueue, config: ServerConfig): Koa {
  const steps = new RequestSteps(queue, config);
  const router = new Router();
  // the web chat page: public (it holds no secret; it asks for the key the API needs); not
  // logged, the log is of API requests
  const page = new WebPage();
  for (const path of page.paths()) router.get(path, async (ctx) => page.serve(ctx));
  for (const route of ROUTES) {
    const run = (ctx: Koa.Context): Promise<void> => steps.run(route, route.handle, ctx);
    if (route.method === "GET") router.get(route.path, run);
    else router.post(route.path, run);
  }
  const app = new Koa();
  app.silent = true; // every error is answered and logged by steps.run; koa's printer would repeat socket errors
  app.use(router.routes());
  app.use(async (ctx) => steps.refuseUnrouted(ctx));
  return app;
}
