// Type declarations of pg-idempotency (hand-written; index.js is the code).

import type { Pool, PoolClient } from 'pg';

/** A duration: milliseconds, or a PostgreSQL interval as text ('2 seconds') */
export type Duration = number | string;

/** What a handler finds on req.idempotency (Express) or request.idempotency (Fastify) */
export interface IdempotencyContext {
  /**
   * Where the handler writes: the pooled client inside the middleware's
   * transaction (one-transaction mode), or the pool (two-transaction mode)
   */
  readonly db: PoolClient | Pool;
  readonly key: string;
  readonly scope: string;
  /** The fencing token: 1, or more for a takeover */
  readonly attempt: number;
  /** How far the attempt taken over got (two-transaction mode), else null */
  readonly recoveryPoint: string | null;
  /** Records how far this attempt got, for a takeover to read */
  checkpoint(recoveryPoint: string | null): Promise<void>;
}

export interface Options<Request = any> {
  /** The pool the middleware claims and completes keys through */
  pool: Pool;
  /** The methods handled; default ['POST', 'PATCH'] */
  methods?: string[];
  /** Answer 400 to a request without a key; default false */
  required?: boolean;
  /** The key's scope; default `${principal}:${METHOD} ${path}` */
  scope?: (req: Request) => string;
  /** The request's fingerprint (null: none); default the SHA-256 of method, path and body */
  fingerprint?: (req: Request, body: Buffer) => string | null;
  /** How long a duplicate waits for the request in flight; default 2000 ms */
  wait?: Duration;
  /** The claim's lease; default the extension's, 60 s in two-transaction mode */
  lease?: Duration;
  /** How long the answer is kept; default the extension's idempotency.key_ttl */
  ttl?: Duration;
  /** default 'one-transaction' */
  mode?: 'one-transaction' | 'two-transaction';
  /** The response headers stored and replayed */
  storeHeaders?: string[];
  /** The largest request body the Express middleware reads itself, in bytes; default 1 MiB */
  limit?: number;
  /** Where an answer not stored, a key not released or a hijacked reply is reported; default process.emitWarning */
  log?: (message: string) => void;
}

/** The Express 5 middleware */
export function express(options: Options): (req: any, res: any, next: (error?: unknown) => void) => Promise<void>;

/** For express.json({ verify: keepRawBody }): keeps the body's bytes for the fingerprint */
export function keepRawBody(req: any, res: any, buf: Buffer): void;

/**
 * The Fastify 5 plugin: fastify.register(fastify, options). The instance
 * is typed loosely so that an app without Fastify needs no Fastify types.
 */
export function fastify(instance: any, options: Options): Promise<void>;

export interface ConsumerOptions<Message> {
  pool: Pool;
  /** The consumer's name: each consumer handles each event once */
  consumer: string;
  /** How long a mark is kept; default the extension's idempotency.event_retention */
  retention?: Duration;
  /** The event's id; default message.id */
  id?: (message: Message) => string | number;
}

/** Wraps a handler: resolves to true when the message was handled now, false for a duplicate */
export function dedup<Message>(
  handler: (message: Message, db: PoolClient) => unknown,
  options: ConsumerOptions<Message>,
): (message: Message) => Promise<boolean>;

/** Wraps a batch handler: resolves to the messages handled now */
export function dedupBatch<Message>(
  handler: (messages: Message[], db: PoolClient) => unknown,
  options: ConsumerOptions<Message>,
): (messages: Message[]) => Promise<Message[]>;

declare global {
  // eslint-disable-next-line @typescript-eslint/no-namespace
  namespace Express {
    interface Request {
      idempotency?: IdempotencyContext;
      rawBody?: Buffer;
    }
  }
}

declare module 'fastify' {
  interface FastifyRequest {
    idempotency: IdempotencyContext | null;
  }
  interface FastifyContextConfig {
    /** This route's options, or false: the plugin leaves the route alone */
    idempotency?: Partial<Omit<Options, 'pool'>> | false;
  }
}
