#!/usr/bin/env node
// radixkv Node.js client: loads the repo's protos/*.proto at run time with @grpc/proto-loader
// (no generated code), streams ModelService.Generate and reads CacheManager.Stats.
//
//   node client/node/radixkv.js generate --addr 127.0.0.1:50052 "Once upon a time" --max-tokens 32
//   node client/node/radixkv.js stats --addr 127.0.0.1:50051
//
// As a library: const { connect } = require('./radixkv'); see connect() below.
'use strict';

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_DIR = path.resolve(__dirname, '..', '..', 'protos');
const LOADER_OPTIONS = {
  keepCase: true, // field names exactly as in the .proto files (max_tokens, token_ids ...)
  longs: String, // uint64 as decimal strings, lossless (epochs use all 64 bits), as proto3 JSON does
  enums: String, // finish_reason: "FINISH_REASON_STOP"
  defaults: true, // unset fields present with their default values
  oneofs: true, // a virtual field naming the set member of each oneof (e.g. "input")
  includeDirs: [PROTO_DIR],
};

// Same policy as the Python client: gRPC's own retries on UNAVAILABLE. A streaming Generate is
// committed (no longer retried) once the server's first response arrives.
const SERVICE_CONFIG = {
  methodConfig: [
    {
      name: [{ service: 'radixkv.v1.ModelService' }, { service: 'radixkv.v1.CacheManager', method: 'Stats' }],
      retryPolicy: {
        maxAttempts: 5,
        initialBackoff: '0.1s',
        maxBackoff: '2s',
        backoffMultiplier: 2,
        retryableStatusCodes: ['UNAVAILABLE'],
      },
    },
  ],
};

/** Loads cache.proto and model.proto; returns the radixkv.v1 package object. */
function loadProtos() {
  const definition = protoLoader.loadSync(['cache.proto', 'model.proto'], LOADER_OPTIONS);
  return grpc.loadPackageDefinition(definition).radixkv.v1;
}

/**
 * Opens stubs: { model, cache } (each only if its address is given).
 * options.token: sent as "authorization: Bearer <token>"; options.rootCerts: PEM Buffer (TLS);
 * options.clientCert / options.clientKey: PEM Buffers of this client's certificate and key, for
 * servers that require mutual TLS (both or neither; imply TLS); options.tls: TLS with the
 * system's roots.
 */
function connect({ modelAddr, cacheAddr, token, rootCerts, tls, clientCert, clientKey } = {}) {
  const v1 = loadProtos();
  if (!clientCert !== !clientKey) throw new UsageError('a client certificate needs its key and a key its certificate');
  const secure = rootCerts || clientCert || tls;
  const creds = secure
    ? grpc.credentials.createSsl(rootCerts || null, clientKey || null, clientCert || null)
    : grpc.credentials.createInsecure();
  const channelOptions = { 'grpc.service_config': JSON.stringify(SERVICE_CONFIG), 'grpc.enable_retries': 1 };
  const metadata = new grpc.Metadata();
  if (token) metadata.set('authorization', `Bearer ${token}`);
  // Several cache-manager shards: "host:port,host:port" (stats asks every one).
  const caches = cacheAddr ? cacheAddr.split(',').map((addr) => addr.trim()) : [];
  if (caches.some((addr) => !addr)) throw new UsageError(`empty cache manager address in ${cacheAddr}`);
  const cacheStubs = caches.map((addr) => new v1.CacheManager(addr, creds, channelOptions));
  return {
    model: modelAddr ? new v1.ModelService(modelAddr, creds, channelOptions) : null,
    cache: cacheStubs.length ? cacheStubs[0] : null,
    caches: cacheStubs,
    metadata,
  };
}

/** Closes every channel of a connection. */
function close(conn) {
  if (conn.model) conn.model.close();
  for (const cache of conn.caches || []) cache.close();
}

function deadline(timeoutS) {
  return timeoutS ? { deadline: Date.now() + timeoutS * 1000 } : {};
}

/** Streams a completion: calls onChunk(GenerateResponse) per message; resolves with the last one. */
function generate(conn, request, { timeoutS, onChunk } = {}) {
  return new Promise((resolve, reject) => {
    let last = null;
    const call = conn.model.Generate(request, conn.metadata, deadline(timeoutS));
    call.on('data', (chunk) => {
      last = chunk;
      if (onChunk) onChunk(chunk);
    });
    call.on('error', reject);
    call.on('end', () => resolve(last));
  });
}

/**
 * CacheManager.Stats: resolves with { pools: [...] }. With several shards, every shard's pools;
 * a poolId is looked for on each (NOT_FOUND only when no shard has it).
 */
async function stats(conn, poolId = '', { timeoutS } = {}) {
  const ask = (cache) => new Promise((resolve, reject) => {
    cache.Stats({ pool_id: poolId }, conn.metadata, deadline(timeoutS), (err, res) =>
      err ? reject(err) : resolve(res),
    );
  });
  const answers = await Promise.allSettled((conn.caches || [conn.cache]).map(ask));
  const pools = [];
  let notFound = null;
  for (const answer of answers) {
    if (answer.status === 'fulfilled') {
      pools.push(...answer.value.pools);
    } else if (poolId && answer.reason.code === grpc.status.NOT_FOUND) {
      notFound = answer.reason;
    } else {
      throw answer.reason;
    }
  }
  if (!pools.length && notFound) throw notFound;
  return answers.length === 1 && answers[0].status === 'fulfilled' ? answers[0].value : { pools };
}

// ------------------------------------------------------------------------------------- CLI

const USAGE = `usage:
  radixkv.js generate "PROMPT" [--addr HOST:PORT] [--max-tokens N] [--temperature T] [--top-p P]
                               [--top-k K] [--seed S] [--stop STR]... [--chat] [--timeout S]
  radixkv.js stats [--addr HOST:PORT[,HOST:PORT...]] [--pool ID] [--timeout S]
options for both: --token TOKEN (or $RADIXKV_TOKEN), --root-certs PEM, --tls,
                  --client-cert PEM --client-key PEM (mutual TLS)`;

const FLAGS = {
  '--addr': 'string',
  '--max-tokens': 'int',
  '--temperature': 'float',
  '--top-p': 'float',
  '--top-k': 'int',
  '--seed': 'int',
  '--stop': 'list',
  '--pool': 'string',
  '--timeout': 'float',
  '--token': 'string',
  '--root-certs': 'string',
  '--client-cert': 'string',
  '--client-key': 'string',
  '--chat': 'bool',
  '--tls': 'bool',
};

function parseArgs(argv) {
  const opts = { positional: [], '--stop': [] };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === '-h' || arg === '--help') throw new UsageError('');
    const kind = FLAGS[arg];
    if (!kind) {
      if (arg.startsWith('--')) throw new UsageError(`unknown option ${arg}`);
      opts.positional.push(arg);
      continue;
    }
    if (kind === 'bool') {
      opts[arg] = true;
      continue;
    }
    if (i + 1 >= argv.length) throw new UsageError(`${arg} needs a value`);
    const raw = argv[++i];
    const value = kind === 'int' ? Number.parseInt(raw, 10) : kind === 'float' ? Number.parseFloat(raw) : raw;
    if (typeof value === 'number' && Number.isNaN(value)) throw new UsageError(`${arg}: not a number: ${raw}`);
    if (kind === 'list') opts[arg].push(value);
    else opts[arg] = value;
  }
  return opts;
}

class UsageError extends Error {}

function generateRequest(prompt, opts) {
  const sampling = { stop: opts['--stop'], top_k: opts['--top-k'] || 0 };
  if (opts['--temperature'] !== undefined) sampling.temperature = opts['--temperature'];
  if (opts['--top-p'] !== undefined) sampling.top_p = opts['--top-p'];
  if (opts['--seed'] !== undefined) sampling.seed = opts['--seed'];
  if (opts['--max-tokens'] !== undefined) sampling.max_tokens = opts['--max-tokens'];
  const request = { sampling };
  if (opts['--chat']) request.chat = { messages: [{ role: 'user', content: prompt }] };
  else request.prompt = prompt;
  return request;
}

async function main(argv) {
  const [command, ...rest] = argv;
  const opts = parseArgs(rest);
  const token = opts['--token'] || process.env.RADIXKV_TOKEN;
  const fs = require('node:fs');
  const rootCerts = opts['--root-certs'] ? fs.readFileSync(opts['--root-certs']) : undefined;
  const clientCert = opts['--client-cert'] ? fs.readFileSync(opts['--client-cert']) : undefined;
  const clientKey = opts['--client-key'] ? fs.readFileSync(opts['--client-key']) : undefined;
  const tlsOptions = { token, rootCerts, tls: opts['--tls'], clientCert, clientKey };
  const timeoutS = opts['--timeout'];
  if (command === 'generate') {
    if (opts.positional.length !== 1) throw new UsageError('generate takes one PROMPT');
    const conn = connect({ modelAddr: opts['--addr'] || '127.0.0.1:50052', ...tlsOptions });
    const request = generateRequest(opts.positional[0], opts);
    await generate(conn, request, { timeoutS, onChunk: (chunk) => process.stdout.write(chunk.text) });
    process.stdout.write('\n');
    conn.model.close();
  } else if (command === 'stats') {
    const conn = connect({ cacheAddr: opts['--addr'] || '127.0.0.1:50051', ...tlsOptions });
    const response = await stats(conn, opts['--pool'] || '', { timeoutS: timeoutS || 30 });
    process.stdout.write(`${JSON.stringify(response, null, 2)}\n`);
    close(conn);
  } else {
    throw new UsageError(command ? `unknown command ${command}` : '');
  }
}

function statusName(code) {
  return Object.keys(grpc.status).find((name) => grpc.status[name] === code) || `CODE_${code}`;
}

if (require.main === module) {
  main(process.argv.slice(2)).then(
    () => process.exit(0),
    (err) => {
      if (err instanceof UsageError) {
        if (err.message) process.stderr.write(`error: ${err.message}\n`);
        process.stderr.write(`${USAGE}\n`);
        process.exit(2);
      }
      if (typeof err.code === 'number') {
        process.stderr.write(`error: ${statusName(err.code)}: ${err.details}\n`);
      } else {
        process.stderr.write(`error: ${err.message}\n`);
      }
      process.exit(1);
    },
  );
}

module.exports = { loadProtos, connect, close, generate, stats, generateRequest, LOADER_OPTIONS, SERVICE_CONFIG };
