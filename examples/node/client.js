#!/usr/bin/env node
// A Node.js client of pagedserve's public gRPC API, built only from the .proto files in
// protos/ (loaded at run time by @grpc/proto-loader, no generated code):
//   1. streams a generation and prints it as it arrives;
//   2. starts a long generation, cancels its call after two deltas, then checks on the
//      scheduler's internal GetLoad that nothing runs or waits any more, and that the gateway
//      no longer knows the request (Abort answers NOT_FOUND);
//   3. sends an invalid request and prints the field violations of the rich error details
//      (the grpc-status-details-bin trailer, a google.rpc.Status).
//
//   node examples/node/client.js --gateway 127.0.0.1:50051 --scheduler 127.0.0.1:50052
//       [--api-key KEY] [--prompt TEXT]
// Exit code 0 when all three behave; 1 otherwise, with the reason on stderr.
'use strict';

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'protos');
const GOOGLE_PROTOS = path.dirname(require.resolve('google-proto-files/package.json'));
const PUBLIC_PROTO = 'pagedserve/v1/gateway.proto';
const INTERNAL_PROTO = 'pagedserve/internal/v1/scheduler.proto';
const LOAD_TIMEOUT_MS = 10000;

function parseArgs(argv) {
  const args = {gateway: '127.0.0.1:50051', scheduler: '', apiKey: process.env.PAGEDSERVE_API_KEY || '',
                prompt: 'The capital of France is'};
  for (let i = 0; i < argv.length; i += 2) {
    const [flag, value] = [argv[i], argv[i + 1]];
    const name = {'--gateway': 'gateway', '--scheduler': 'scheduler', '--api-key': 'apiKey',
                  '--prompt': 'prompt'}[flag];
    if (!name || value === undefined) {
      throw new Error(`unknown flag or missing value: ${flag}`);
    }
    args[name] = value;
  }
  return args;
}

function loadServices() {
  const definition = protoLoader.loadSync([PUBLIC_PROTO, INTERNAL_PROTO], {
    includeDirs: [PROTO_ROOT], keepCase: true, longs: String, enums: String, defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).pagedserve;
}

// google.rpc.Status and its detail messages, for decoding the trailer.
function loadStatusTypes() {
  const root = new protobuf.Root();
  root.resolvePath = (origin, target) => (
    target.startsWith('google/rpc/') ? path.join(GOOGLE_PROTOS, target) : target);
  root.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], {keepCase: true});
  return root;
}

function unary(client, method, request, metadata) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, {deadline: Date.now() + 30000},
                   (error, response) => (error ? reject(error) : resolve(response)));
  });
}

function streamRequest(text, sampling, requestId = '') {
  return {request_id: requestId, text, sampling};
}

async function streamGeneration(generation, metadata, prompt) {
  const call = generation.GenerateStream(
    streamRequest(prompt, {temperature: 0, max_tokens: 16}), metadata);
  let text = '';
  let finish = '';
  process.stdout.write('stream: ');
  for await (const delta of call) {
    process.stdout.write(delta.text);
    text += delta.text;
    if (delta.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
      finish = delta.finish_reason;
    }
  }
  process.stdout.write('\n');
  console.log(`stream finished: ${finish} (${text.length} characters)`);
  return finish !== '';
}

function waitForDeltasThenCancel(call, numDeltas) {
  return new Promise((resolve, reject) => {
    let seen = 0;
    call.on('data', () => {
      seen += 1;
      if (seen === numDeltas) {
        call.cancel();
      }
    });
    call.on('error', (error) => (
      error.code === grpc.status.CANCELLED ? resolve(seen) : reject(error)));
    call.on('end', () => reject(new Error('the stream ended before it was cancelled')));
  });
}

async function cancelAndVerify(generation, scheduler, metadata) {
  const requestId = `node-cancel-${process.pid}`;
  const call = generation.GenerateStream(streamRequest(
    'Count to a thousand:', {temperature: 0, max_tokens: 400, ignore_eos: true}, requestId),
  metadata);
  const seen = await waitForDeltasThenCancel(call, 2);
  console.log(`cancelled ${requestId} after ${seen} deltas`);
  if (scheduler) {
    const end = Date.now() + LOAD_TIMEOUT_MS;
    for (;;) {
      const load = await unary(scheduler, 'GetLoad', {}, new grpc.Metadata());
      if (load.num_running_requests === 0 && load.num_waiting_requests === 0) {
        console.log(`scheduler load after cancel: running ${load.num_running_requests}, waiting ` +
                    `${load.num_waiting_requests}, gpu blocks used ${load.num_gpu_blocks_used}`);
        break;
      }
      if (Date.now() > end) {
        throw new Error(`the cancelled request still runs: ${JSON.stringify(load)}`);
      }
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
  }
  try {
    await unary(generation, 'Abort', {request_id: requestId}, metadata);
  } catch (error) {
    if (error.code === grpc.status.NOT_FOUND) {
      console.log(`gateway: ${requestId} is gone (Abort answers NOT_FOUND)`);
      return true;
    }
    throw error;
  }
  console.error(`the gateway still knew ${requestId} after its call was cancelled`);
  return false;
}

function printRichError(error, statusTypes) {
  console.log(`error: ${grpc.status[error.code]}: ${error.details}`);
  const [bytes] = error.metadata ? error.metadata.get('grpc-status-details-bin') : [];
  if (!bytes) {
    return 0;
  }
  const status = statusTypes.lookupType('google.rpc.Status').decode(bytes);
  let numViolations = 0;
  for (const detail of status.details) {
    const typeName = detail.type_url.slice(detail.type_url.lastIndexOf('/') + 1);
    const message = statusTypes.lookupType(typeName).decode(detail.value);
    if (typeName === 'google.rpc.BadRequest') {
      for (const violation of message.field_violations) {
        console.log(`field violation: ${violation.field}: ${violation.description}`);
        numViolations += 1;
      }
    } else if (typeName === 'google.rpc.ErrorInfo') {
      console.log(`error info: reason ${message.reason}, domain ${message.domain}`);
    } else if (typeName === 'google.rpc.RetryInfo') {
      console.log(`retry info: retry after ${message.retry_delay.seconds}s ` +
                  `${message.retry_delay.nanos}ns`);
    }
  }
  return numViolations;
}

async function showFieldViolation(generation, metadata, statusTypes) {
  try {
    await unary(generation, 'Generate', streamRequest('hello', {temperature: -1}), metadata);
  } catch (error) {
    if (error.code !== grpc.status.INVALID_ARGUMENT) {
      throw error;
    }
    if (printRichError(error, statusTypes) > 0) {
      return true;
    }
    console.error('the status carried no google.rpc.BadRequest field violation');
    return false;
  }
  console.error('an invalid temperature was accepted');
  return false;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const services = loadServices();
  const statusTypes = loadStatusTypes();
  const credentials = grpc.credentials.createInsecure();
  const generation = new services.v1.GenerationService(args.gateway, credentials);
  const models = new services.v1.ModelService(args.gateway, credentials);
  const scheduler = (args.scheduler ?
    new services.internal.v1.SchedulerService(args.scheduler, credentials) : null);
  const metadata = new grpc.Metadata();
  if (args.apiKey) {
    metadata.set('authorization', `Bearer ${args.apiKey}`);
  }
  try {
    const info = await unary(models, 'GetModelInfo', {}, metadata);
    console.log(`model: ${info.model} (${info.architecture}, max_model_len ${info.max_model_len})`);
    const ok = [
      await streamGeneration(generation, metadata, args.prompt),
      await cancelAndVerify(generation, scheduler, metadata),
      await showFieldViolation(generation, metadata, statusTypes),
    ];
    return ok.every(Boolean) ? 0 : 1;
  } finally {
    for (const client of [generation, models, scheduler]) {
      if (client) {
        client.close();
      }
    }
  }
}

main().then((code) => {
  process.exitCode = code;
}, (error) => {
  console.error(`failed: ${error.stack || error}`);
  process.exitCode = 1;
});
