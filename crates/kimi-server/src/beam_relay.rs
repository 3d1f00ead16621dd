//! Beam search requests: one engine request, `n` choices. The engine sends the best beams
//! at the end ([`Event::Beams`]); [`BeamRelay`] replays each beam to its choice as the
//! events of an ordinary sequence (`Started`, its tokens, `Finished`), so stop strings,
//! logprobs and the JSON body are made as for sampled choices. Nothing is streamed (vLLM
//! does not stream beams either); the parameters refuse `stream` with beam search.

use std::task::{Context, Poll};

use kimi_engine::serving::Event;
use kimi_engine::FinishReason;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// Fans one beam search request's events out to its choices.
pub(crate) struct BeamRelay {
    engine: UnboundedReceiver<Event>,
    choices: Vec<UnboundedSender<Event>>,
    prompt_tokens: usize,
}

impl BeamRelay {
    /// A relay for `n` choices, and each choice's receiver.
    pub(crate) fn new(
        engine: UnboundedReceiver<Event>,
        n: usize,
        prompt_tokens: usize,
    ) -> (Self, Vec<UnboundedReceiver<Event>>) {
        let (choices, receivers) = (0..n).map(|_| unbounded_channel()).unzip();
        let relay = Self {
            engine,
            choices,
            prompt_tokens,
        };
        (relay, receivers)
    }

    /// Forwards what the engine has sent; `Ready` once the request ended (the relay is
    /// then spent and the choices have their last events).
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            let event = match self.engine.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(event) => event,
            };
            match event {
                Some(Event::Started { queued_secs }) => {
                    self.to_all(&Event::Started { queued_secs });
                }
                Some(Event::Beams(beams)) => {
                    for (i, choice) in std::mem::take(&mut self.choices).into_iter().enumerate() {
                        let Some(beam) = beams.get(i) else {
                            let message = format!(
                                "beam search found {} beams, fewer than the {} choices asked for",
                                beams.len(),
                                i + 1
                            );
                            let _ = choice.send(Event::Error(message));
                            continue;
                        };
                        for token in &beam.tokens {
                            let _ = choice.send(Event::Token(token.clone()));
                        }
                        let _ = choice.send(Event::Finished {
                            reason: beam.finish,
                            prompt_tokens: self.prompt_tokens,
                            completion_tokens: beam.tokens.len(),
                        });
                    }
                    return Poll::Ready(());
                }
                Some(Event::Finished { reason, .. }) => {
                    // Without `Beams` first: cancelled before any beam finished.
                    self.to_all(&Event::Finished {
                        reason: if reason == FinishReason::Cancelled {
                            reason
                        } else {
                            FinishReason::Length
                        },
                        prompt_tokens: self.prompt_tokens,
                        completion_tokens: 0,
                    });
                    return Poll::Ready(());
                }
                Some(Event::Error(message)) => {
                    self.to_all(&Event::Error(message));
                    return Poll::Ready(());
                }
                // Beam requests get no streamed tokens; a closed channel closes the choices.
                Some(Event::Token(_)) => {}
                None => {
                    self.choices.clear();
                    return Poll::Ready(());
                }
            }
        }
    }

    fn to_all(&self, event: &Event) {
        for choice in &self.choices {
            let _ = choice.send(event.clone());
        }
    }
}
