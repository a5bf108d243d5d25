//! OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.
//! Internal errors are logged with the request id and masked for the client.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", param, code: None }
    }

    pub fn context_length(message: impl Into<String>, param: &'static str) -> ApiError {
        ApiError { code: Some("context_length_exceeded"), ..ApiError::invalid(message, Some(param)) }
    }

    pub fn model_not_found(model: &str, served: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist; this server serves `{served}`"),
            kind: "invalid_request_error",
            param: Some("model"),
            code: Some("model_not_found"),
        }
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "Invalid or missing API key; send `Authorization: Bearer <key>`".into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn busy(message: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::TOO_MANY_REQUESTS, message: message.into(), kind: "rate_limit_error", param: None, code: Some("server_busy") }
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::SERVICE_UNAVAILABLE, message: message.into(), kind: "service_unavailable", param: None, code: None }
    }

    pub fn not_found(path: &str) -> ApiError {
        ApiError { status: StatusCode::NOT_FOUND, message: format!("no route for {path}"), kind: "invalid_request_error", param: None, code: None }
    }

    /// Logs the real cause; the client only sees the request id.
    pub fn internal(request_id: &str, cause: impl std::fmt::Display) -> ApiError {
        eprintln!("[{request_id}] internal error: {cause}");
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!("internal server error (request id {request_id})"),
            kind: "internal_error",
            param: None,
            code: None,
        }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        // Busy or loading: tell well-behaved clients (and the openai client) when to come back.
        if matches!(self.status, StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE) {
            r.headers_mut().insert("retry-after", axum::http::HeaderValue::from_static("1"));
        }
        r
    }
}
