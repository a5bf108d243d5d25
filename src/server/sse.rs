//! Server-sent events for streaming responses: one `data:` line per chunk, an error chunk if
//! generation fails midway, and `data: [DONE]` at the end.

use super::generation::{Generation, Piece};
use super::RequestId;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use std::convert::Infallible;

/// Streams `gen` through `render`, which turns each piece into zero or more JSON chunks.
pub fn sse_response<F>(gen: Generation, rid: RequestId, render: F) -> Response
where
    F: FnMut(Piece) -> Vec<serde_json::Value> + Send + 'static,
{
    Sse::new(events(gen, rid, render)).keep_alive(KeepAlive::default()).into_response()
}

fn events<F>(gen: Generation, rid: RequestId, render: F) -> impl Stream<Item = Result<Event, Infallible>>
where
    F: FnMut(Piece) -> Vec<serde_json::Value> + Send + 'static,
{
    // State: the generation (None once finished), the renderer, and chunks ready to send.
    stream::unfold((Some(gen), render, Vec::<Event>::new(), false), move |(mut gen, mut render, mut ready, mut done)| {
        let rid = rid.clone();
        async move {
            loop {
                if !ready.is_empty() {
                    let e = ready.remove(0);
                    return Some((Ok(e), (gen, render, ready, done)));
                }
                if done {
                    return None;
                }
                let Some(g) = gen.as_mut() else {
                    done = true;
                    ready.push(Event::default().data("[DONE]"));
                    continue;
                };
                match g.next(&rid.0).await {
                    Some(Ok(piece)) => {
                        let finished = matches!(piece, Piece::Done { .. });
                        ready.extend(render(piece).into_iter().map(|v| Event::default().data(v.to_string())));
                        if finished {
                            gen = None;
                        }
                    }
                    Some(Err(e)) => {
                        ready.push(Event::default().data(e.body().to_string()));
                        gen = None;
                    }
                    None => gen = None,
                }
            }
        }
    })
}
